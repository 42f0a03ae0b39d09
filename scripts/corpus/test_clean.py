#!/usr/bin/env python3
# Unit tests of scripts/corpus/clean.py on small inline inputs (ctest `corpus_clean_py`): HTML,
# roff and POD to prose, the prose filter, gcide and WordNet documents, boilerplate removal,
# exact and near-duplicate detection, the hashed validation split and an end-to-end run on a
# generated package tree.
import gzip
import json
import os
import tempfile
import unittest

import clean

PROSE = ('The quick brown fox jumps over the lazy dog while the farmer watches from the porch and '
         'wonders whether the weather will hold until the harvest is finally done this year')


def read(path):
    with open(path, encoding='utf-8') as f:
        return f.read()


class Extraction(unittest.TestCase):
    def test_html_drops_code_navigation_and_scripts(self):
        page = ('<html><head><title>T</title><script>var x = 1;</script></head><body>'
                '<nav><a href="/">Home</a> Previous topic</nav>'
                '<div class="sphinxsidebar"><p>Quick search box text</p></div>'
                '<h1>Heading one<a class="headerlink" href="#h">\u00b6</a></h1>'
                '<p>First &amp; <em>second</em> words.<br>After a break.</p>'
                '<pre>int main() { return 0; }</pre><li>An item</li></body></html>')
        paras = clean.html_paragraphs(page)
        self.assertEqual(paras, ['Heading one', 'First & second words.', 'After a break.', 'An item'])

    def test_is_prose(self):
        self.assertTrue(clean.is_prose(PROSE))
        self.assertFalse(clean.is_prose('Too short here'))
        self.assertFalse(clean.is_prose('x = foo(a, b); if (x > 0) { return y[i] * 2; } else { z = {}; }'))
        self.assertFalse(clean.is_prose('call foo_bar() then baz_qux() and a.b.c() or d::e() now'))
        self.assertFalse(clean.is_prose('12345 67890 1234 5678 9012 3456 7890 1234'))

    def test_roff(self):
        page = ('.\\" a comment\n.TH LS 1\n.SH NAME\nls \\- list directory contents\n.SH SYNOPSIS\n.B ls\n'
                '[\\fIOPTION\\fR]...\n.SH DESCRIPTION\nList information about the\n.B FILEs\n(the current '
                'directory by default).\n.PP\nSecond paragraph\\(emwith a dash.\n.nf\ncode line\n.fi\n'
                '.SH SEE ALSO\ndir(1)\n')
        self.assertEqual(clean.roff_paragraphs(page), [
            'ls - list directory contents',
            'List information about the FILEs (the current directory by default).',
            'Second paragraph-with a dash.'])

    def test_pod(self):
        pod = ('=head1 NAME\n\nperlfoo - a B<bold> test\n\n=head2 Usage\n\nCall C<foo()> with L<the docs|perlfunc>.\n\n'
               '    my $x = 1;  # verbatim code\n\n=begin html\n\n<p>raw</p>\n\n=end html\n\n=cut\n')
        self.assertEqual(clean.pod_paragraphs(pod),
                         ['NAME', 'perlfoo - a bold test', 'Usage', 'Call foo() with the docs.'])

    def test_gcide(self):
        text = ('00-database-info\nheader\n\nAbdicator \\Ab"di*ca`tor\\, n.\n   One who abdicates.\n'
                '   [1913 Webster]\n\nAbditive \\Ab"di*tive\\, a. [L. abditivus.]\n   Having the quality of hiding.\n')
        docs = clean.gcide_documents(text, 'dict-gcide', chunk_bytes=10)
        self.assertEqual([d[0] for d in docs], ['dict-gcide:00000:Abdicator', 'dict-gcide:00001:Abditive'])
        self.assertEqual(docs[0][1], ['Abdicator , n. One who abdicates.'])

    def test_wordnet(self):
        with tempfile.TemporaryDirectory() as d:
            p = os.path.join(d, 'data.noun')
            with open(p, 'w') as f:
                f.write('  1 This software and database is being provided\n'
                        '00045250 04 n 02 propulsion 0 actuation 0 000 | the act of propelling  \n'
                        '00045646 04 n 01 rally(a) 1 000 | the feat of mustering strength\n')
            docs = clean.wordnet_documents([p])
        self.assertEqual(docs, [('wordnet:data.noun:04', ['propulsion, actuation: the act of propelling',
                                                           'rally: the feat of mustering strength'])])


class Selection(unittest.TestCase):
    def test_boilerplate(self):
        docs = [(f'd{i}', ['Previous topic', f'unique text {i}']) for i in range(6)]
        kept, n = clean.drop_boilerplate(docs, min_docs=5)
        self.assertEqual(n, 1)
        self.assertEqual(kept[0], ('d0', ['unique text 0']))
        kept, n = clean.drop_boilerplate(docs[:4], min_docs=5)  # in too few documents: kept
        self.assertEqual(n, 0)

    def test_duplicates(self):
        words = [f'w{i}' for i in range(400)]
        a = ' '.join(words)
        near = ' '.join(words[:395] + ['changed'] * 5)
        other = ' '.join(f'v{i}' for i in range(400))
        d = clean.Deduplicator()
        self.assertIsNone(d.check(a))
        self.assertEqual(d.check(a.upper()), 'exact')  # case and spacing are normalized
        self.assertEqual(d.check(near), 'near')
        self.assertIsNone(d.check(other))
        self.assertGreater(clean.sketch_similarity(clean.shingle_sketch(a), clean.shingle_sketch(near)), 0.8)
        self.assertLess(clean.sketch_similarity(clean.shingle_sketch(a), clean.shingle_sketch(other)), 0.1)

    def test_validation_split(self):
        ids = [f'pkg:file{i}.html' for i in range(4000)]
        held = [i for i in ids if clean.is_validation(i, 0.05)]
        self.assertTrue(150 < len(held) < 250, len(held))
        self.assertEqual(held, [i for i in ids if clean.is_validation(i, 0.05)])  # deterministic
        self.assertEqual([i for i in ids if clean.is_validation(i, 0.0)], [])


class EndToEnd(unittest.TestCase):
    def test_package_tree(self):
        with tempfile.TemporaryDirectory() as d:
            root, out = os.path.join(d, 'root'), os.path.join(d, 'out')
            html_dir = os.path.join(root, 'python3.11-doc', 'usr/share/doc/python3.11/html')
            man_dir = os.path.join(root, 'manpages', 'usr/share/man/man1')
            os.makedirs(html_dir)
            os.makedirs(man_dir)
            for i in range(30):
                body = ''.join(f'<p>{PROSE} page {i} paragraph {j} number {i * 100 + j}.</p>' for j in range(3))
                with open(os.path.join(html_dir, f'p{i}.html'), 'w') as f:
                    f.write(f'<html><body>{body}</body></html>')
            with open(os.path.join(html_dir, 'copy.html'), 'w') as f:  # an exact duplicate of p0
                f.write(read(os.path.join(html_dir, 'p0.html')))
            with open(os.path.join(html_dir, 'genindex.html'), 'w') as f:  # an index page: left out
                f.write(f'<p>{PROSE} index</p>' * 5)
            with open(os.path.join(man_dir, 'x.1.gz'), 'wb') as f:
                f.write(gzip.compress(f'.TH X 1\n.SH DESCRIPTION\n{PROSE}.\n.PP\n{PROSE} again.\n.PP\n{PROSE} thrice.\n'.encode()))
            self.assertEqual(clean.main(['--root', root, '--out', out, '--val-fraction', '0.2']), 0)
            train, val = read(os.path.join(out, 'train.txt')), read(os.path.join(out, 'val.txt'))
            docs = [x for x in (train + val).split('\n\n') if x.strip()]
            self.assertEqual(len(docs), 31)  # 30 pages + the man page; the copy and the index dropped
            self.assertTrue(0 < val.count('\n\n') < 15)
            self.assertNotIn('index', train + val)
            stats = json.loads(read(os.path.join(out, 'stats.json')))
            self.assertEqual(stats['python3.11-doc']['exact_duplicates'], 1)
            self.assertEqual(clean.main(['--root', root, '--out', out, '--packages', 'no-such-package']), 2)


if __name__ == '__main__':
    unittest.main()
