#!/usr/bin/env python3
# The corpus cleaner of scripts/corpus/build.sh: turns the files of extracted Debian packages
# (ROOT/<package>/usr/share/...) into plain English prose, one document per source document
# (an HTML page, a man page, a POD file, a block of dictionary entries), one paragraph per line,
# documents separated by one blank line (the layout `nibble` splits documents at). Markup is
# removed (HTML, roff, POD), code blocks and code-like paragraphs are dropped, paragraphs repeated
# across many documents of a package (navigation, footers) are dropped as boilerplate, exact and
# near-duplicate documents (bottom-k MinHash over word 5-grams) are dropped, and every document
# goes to train.txt or val.txt by a hash of its id (package:path). Python stdlib only.
import argparse
import gzip
import hashlib
import html
import json
import os
import re
import sys
import zlib
from collections import Counter

# ---- paragraphs ------------------------------------------------------------------------------

CODE_CHARS = set('{}[]<>=;$#\\|@^~`_*/')


def normalize_space(text):
    return ' '.join(text.split())


def is_prose(paragraph, min_words=4):
    """A paragraph that reads as English prose: enough words, mostly letters, few code symbols."""
    words = paragraph.split()
    if len(words) < min_words:
        return False
    n = len(paragraph)
    letters = sum(c.isalpha() for c in paragraph)
    if letters < 0.65 * n:
        return False
    if sum(c in CODE_CHARS for c in paragraph) > 0.04 * n:
        return False
    # identifiers such as foo_bar() or a.b.c() in most words
    codeish = sum(1 for w in words if '(' in w or '_' in w or w.count('.') >= 2 or '::' in w)
    return codeish <= 0.2 * len(words)


# ---- HTML ------------------------------------------------------------------------------------

SKIP_TAGS = {'script', 'style', 'pre', 'nav', 'header', 'footer', 'table', 'svg', 'math', 'head', 'button',
             'select', 'textarea', 'noscript', 'form', 'samp', 'kbd'}
SKIP_CLASSES = {'highlight', 'sphinxsidebar', 'related', 'footer', 'headerlink', 'sidebar', 'toc', 'nav', 'navbar',
                'breadcrumb', 'breadcrumbs', 'header', 'sub-nav', 'toctree-wrapper', 'viewcode-link', 'copyright',
                'member-signature', 'signature', 'code-header', 'example-wrap', 'docblock-short', 'src', 'search',
                'rustdoc-breadcrumbs', 'sourcecode', 'programlisting', 'screen', 'synopsis', 'literal-block',
                'doctest', 'linenos', 'navheader', 'navfooter', 'SCodeFlow', 'tocset', 'navsetleft', 'navsettop',
                'navsetbottom', 'searchbox', 'prev-next', 'top-bar', 'bottom-bar'}
BLOCK_TAGS = {'p', 'div', 'li', 'dd', 'dt', 'h1', 'h2', 'h3', 'h4', 'h5', 'h6', 'br', 'tr', 'section', 'blockquote',
              'td', 'th', 'ul', 'ol', 'dl', 'article', 'main', 'hr', 'figcaption', 'caption', 'title', 'body'}
VOID_TAGS = {'br', 'hr', 'img', 'meta', 'link', 'input', 'area', 'base', 'col', 'embed', 'source', 'track', 'wbr'}


HTML_COMMENT = re.compile(r'<!--.*?-->|<!\[CDATA\[.*?\]\]>', re.S)
HTML_SKIP = re.compile(r'<(%s)\b[^>]*>.*?</\1\s*>' % '|'.join(sorted(SKIP_TAGS)), re.S | re.I)
HTML_SKIP_CLASS = re.compile(r'<(div|span|a|p|section|dl|ul|aside)\b[^>]*\b(?:class|role)="(?:[^"]*\s)?(?:%s)(?:\s[^"]*)?"'
                             r'[^>]*>.*?</\1\s*>' % '|'.join(re.escape(c) for c in sorted(SKIP_CLASSES | {
                                 'navigation', 'search', 'banner', 'contentinfo'})), re.S | re.I)
HTML_BLOCK = re.compile(r'</?(?:%s)\b[^>]*>' % '|'.join(sorted(BLOCK_TAGS)), re.I)
HTML_TAG = re.compile(r'<[^>]*>')


def html_paragraphs(text):
    """Paragraphs of an HTML page: comments and the subtrees of SKIP_TAGS / SKIP_CLASSES removed
    (regular expressions, first matching end tag: generated documentation nests few of them),
    block tags as paragraph breaks, other tags dropped, entities decoded."""
    text = HTML_COMMENT.sub(' ', text)
    text = HTML_SKIP.sub('\x00', text)
    text = HTML_SKIP_CLASS.sub('\x00', text)
    text = HTML_BLOCK.sub('\x00', text)
    text = HTML_TAG.sub('', text)
    out = []
    for part in text.split('\x00'):
        p = normalize_space(html.unescape(part).replace('\u00b6', ''))
        if p:
            out.append(p)
    return out


# ---- roff (man pages) ------------------------------------------------------------------------

ROFF_ESCAPES = [(re.compile(r'\\f(\[[^\]]*\]|\(..|.)'), ''), (re.compile(r'\\\((em|en)'), '-'),
                (re.compile(r'\\\((aq|cq|oq)'), "'"), (re.compile(r'\\\((lq|rq|dq)'), '"'),
                (re.compile(r'\\\*\((lq|rq)'), '"'), (re.compile(r'\\\(bu'), ''), (re.compile(r'\\\(..'), ''),
                (re.compile(r'\\\[[^\]]*\]'), ''), (re.compile(r'\\[-]'), '-'), (re.compile(r'\\[&|^%:]'), ''),
                (re.compile(r'\\e'), lambda m: '\\'), (re.compile(r'\\ '), ' '), (re.compile(r'\\s[-+]?\d'), ''),
                (re.compile(r'\\\*.'), ''), (re.compile(r'\\.'), '')]
ROFF_BREAK = {'PP', 'LP', 'P', 'TP', 'IP', 'HP', 'sp', 'br', 'SH', 'SS', 'RS', 'RE', 'TQ', 'in', 'ti', 'bp'}
ROFF_TEXT = {'B', 'I', 'BR', 'IR', 'RB', 'BI', 'IB', 'RI', 'SM', 'SB'}
ROFF_SKIP_SECTIONS = {'SYNOPSIS', 'SEE ALSO', 'COLOPHON', 'AUTHOR', 'AUTHORS', 'EXAMPLES', 'EXAMPLE', 'COPYRIGHT'}


def roff_unescape(s):
    for rx, rep in ROFF_ESCAPES:
        s = rx.sub(rep, s)
    return s


def roff_paragraphs(text):
    paragraphs, buf = [], []
    no_fill = skip_section = False

    def flush():
        if buf:
            p = normalize_space(' '.join(buf))
            if p and not skip_section:
                paragraphs.append(p)
            buf.clear()

    for line in text.split('\n'):
        if line.startswith(('.\\"', "'\\\"", '\\"')):
            continue
        if line.startswith(('.', "'")):
            parts = line[1:].strip().split(None, 1)
            macro = parts[0] if parts else ''
            arg = parts[1] if len(parts) > 1 else ''
            if macro in ('nf', 'EX'):
                flush()
                no_fill = True
            elif macro in ('fi', 'EE'):
                no_fill = False
            elif macro in ('SH', 'SS'):
                flush()
                heading = roff_unescape(arg.replace('"', '')).strip()
                skip_section = heading.upper() in ROFF_SKIP_SECTIONS
            elif macro in ROFF_BREAK:
                flush()
                if macro in ('TP', 'TQ'):  # the next line is a tag (an option name): its own paragraph
                    pass
            elif macro in ROFF_TEXT and not no_fill:
                buf.append(roff_unescape(arg.replace('"', '')))
            continue
        if no_fill:
            continue
        if not line.strip():
            flush()
            continue
        buf.append(roff_unescape(line))
    flush()
    return paragraphs


# ---- POD (Perl documentation) ----------------------------------------------------------------

POD_CODE = re.compile(r'[A-Z]<(<+\s)?((?:(?!>).)*?)(\s>+)?>')


def pod_unformat(s):
    for _ in range(4):  # nested formatting codes
        t = POD_CODE.sub(lambda m: m.group(2).split('|')[0] if not m.group(0).startswith(('X<', 'Z<')) else '', s)
        if t == s:
            break
        s = t
    return s


def pod_paragraphs(text):
    paragraphs, skip_block = [], False
    for block in re.split(r'\n[ \t]*\n', text):
        if not block.strip():
            continue
        if block.startswith('='):
            cmd, _, rest = block[1:].partition(' ')
            cmd = cmd.split('\n')[0]
            if cmd == 'begin':
                skip_block = True
            elif cmd == 'end':
                skip_block = False
            elif cmd.startswith('head') or cmd == 'item':
                rest = normalize_space(pod_unformat(rest))
                if rest and not skip_block:
                    paragraphs.append(rest)
            continue
        if skip_block or block[0] in ' \t':  # verbatim (code) paragraph
            continue
        paragraphs.append(normalize_space(pod_unformat(block)))
    return paragraphs


# ---- dictionaries ----------------------------------------------------------------------------

GCIDE_PRON = re.compile(r'\\[^\\\n]*\\')
GCIDE_SOURCE = re.compile(r'\[(1913 Webster|Webster 1913 Suppl\.|PJC|WordNet 1\.5|Century Dict\.|RHUD|MW\d*|'
                          r'Chambers 1881|Elem\. Bot\.|[A-Z][A-Za-z .]*\d{4}[A-Za-z .]*)\]')


def gcide_documents(text, name, chunk_bytes=65536):
    """Entries (blank-line separated, header entries starting with '00-database' dropped), cleaned of
    pronunciations and source tags, one entry per paragraph, grouped into documents of ~chunk_bytes."""
    docs, paras, size, first = [], [], 0, None
    for entry in text.split('\n\n'):
        entry = entry.strip()
        if not entry or entry.startswith('00-database') or entry.startswith('00database'):
            continue
        p = normalize_space(GCIDE_SOURCE.sub('', GCIDE_PRON.sub('', entry)))
        if len(p.split()) < 3:
            continue
        if first is None:
            first = p.split()[0]
        paras.append(p)
        size += len(p) + 1
        if size >= chunk_bytes:
            docs.append((f'{name}:{len(docs):05d}:{first}', paras))
            paras, size, first = [], 0, None
    if paras:
        docs.append((f'{name}:{len(docs):05d}:{first}', paras))
    return docs


WN_LEXNAMES = {}


def wordnet_documents(files):
    """WordNet data.* files: one paragraph per synset ("w1, w2: gloss"), one document per lexicographer
    file number and part of speech."""
    groups = {}
    for path in files:
        with open(path, encoding='utf-8', errors='replace') as f:
            for line in f:
                if line.startswith('  ') or '|' not in line:
                    continue
                head, gloss = line.split('|', 1)
                fields = head.split()
                lex, pos, n = fields[1], fields[2], int(fields[3], 16)
                words = [fields[4 + 2 * i].replace('_', ' ') for i in range(n)]
                words = [re.sub(r'\([a-z]+\)$', '', w) for w in words]
                groups.setdefault((os.path.basename(path), lex), []).append(
                    f'{", ".join(words)}: {normalize_space(gloss)}')
    return [(f'wordnet:{k[0]}:{k[1]}', v) for k, v in sorted(groups.items())]


# ---- sources ---------------------------------------------------------------------------------

def read_text(path):
    with open(path, 'rb') as f:
        data = f.read()
    if path.endswith('.gz'):
        data = gzip.decompress(data)
    return data.decode('utf-8', errors='replace')


def walk(root, suffixes, exclude=()):
    out = []
    for d, dirs, files in os.walk(root):
        dirs.sort()
        for f in sorted(files):
            p = os.path.join(d, f)
            rel = os.path.relpath(p, root)
            if f.endswith(suffixes) and not any(re.search(x, rel) for x in exclude):
                out.append(p)
    return out


# Per package: the format, the files (suffixes under the package root) and paths to leave out
# (indexes, search pages, source listings, translations).
HTML_EXCLUDE = (r'genindex', r'search\.html', r'/_sources/', r'/_modules/', r'py-modindex', r'/src/', r'doc-index',
                r'index-files/', r'allclasses', r'overview-tree', r'package-tree', r'/sidebar-items', r'/all\.html$',
                r'/class-use/', r'deprecated-list', r'\.(?!en\.)[a-z]{2}(_[a-z]{2})?\.html$', r'/(de|fr|es|it|ja|ko|zh|nl|'
                r'pt|ru|cs|hu|ca|pl)/')
# Packages whose .html pages need no rule beyond HTML_EXCLUDE.
PLAIN_HTML = '''
    postgresql-doc-15 python-django-doc python-scipy-doc python-statsmodels-doc sagemath-doc
    racket-doc erlang-doc openjdk-17-doc octave-doc libreoffice-help-en-us debian-policy
    debian-reference-en developers-reference cmake-doc llvm-15-doc clang-15-doc
    python-sqlalchemy-doc sphinx-doc fp-docs-3.2.2 postfix-doc exim4-doc-html bind9-doc zsh-doc
    bash-doc python-sympy-doc python-scrapy-doc python-werkzeug-doc python-flask-doc
    python-requests-doc python-setuptools-doc maxima-doc gimp-help-en
'''.split()
SOURCES = {
    **{p: ('html', ('.html',), HTML_EXCLUDE) for p in PLAIN_HTML},
    'linux-doc-6.1': ('html', ('.html',), HTML_EXCLUDE + (r'/Documentation/',)),
    'python3.11-doc': ('html', ('.html',), HTML_EXCLUDE + (r'/devhelp/',)),
    'python-pandas-doc': ('html', ('.html',), HTML_EXCLUDE + (r'/reference/api/',)),
    'lilypond-doc-html': ('html', ('.html',), HTML_EXCLUDE + (r'-big-page', r'\.(de|es|fr|hu|it|ja|nl|zh|cs|ca|pt|'
                                                                      r'bg)\.html')),
    'ghc-doc': ('html', ('.html',), HTML_EXCLUDE + (r'/src/', r'doc-index')),
    'rust-doc': ('html', ('.html',), HTML_EXCLUDE + (r'/(src|implementors)/',)),
    'git-doc': ('html', ('.html',), HTML_EXCLUDE + (r'RelNotes',)),
    'nodejs-doc': ('html', ('.html',), HTML_EXCLUDE + (r'/all\.html',)),
    'libboost1.81-doc': ('html', ('.html', '.htm'), HTML_EXCLUDE),
    'python-astropy-doc': ('html', ('.html',), HTML_EXCLUDE + (r'/api/',)),
    'python-sklearn-doc': ('html', ('.html',), HTML_EXCLUDE + (r'/generated/',)),
    'apache2-doc': ('html', ('.html.en',), HTML_EXCLUDE),
    'manpages': ('roff', ('.gz',), (r'^(?!usr/share/man/)',)),
    'manpages-dev': ('roff', ('.gz',), (r'^(?!usr/share/man/)',)),
    'perl-doc': ('pod', ('.pod',), (r'delta\.pod$', r'perlhist', r'perltoc')),
    'dict-gcide': ('gcide', ('gcide.dict.dz',), ()),
    'wordnet-base': ('wordnet', tuple(f'data.{p}' for p in ('noun', 'verb', 'adj', 'adv')), ()),
}


def package_documents(pkg, root):
    """(document id, [paragraphs]) of one extracted package, in a fixed order."""
    kind, suffixes, exclude = SOURCES[pkg]
    files = walk(root, suffixes, exclude)
    if kind == 'gcide':
        return [d for f in files for d in gcide_documents(read_text(f) if not f.endswith('.dz')
                                                          else gzip.decompress(open(f, 'rb').read()).decode(
                                                              'utf-8', errors='replace'), pkg)]
    if kind == 'wordnet':
        return wordnet_documents(files)
    extract = {'html': html_paragraphs, 'roff': roff_paragraphs, 'pod': pod_paragraphs}[kind]
    docs = []
    for f in files:
        if os.path.islink(f):
            continue
        paras = [p for p in extract(read_text(f)) if is_prose(p)]
        docs.append((f'{pkg}:{os.path.relpath(f, root)}', paras))
    return docs


# ---- boilerplate and duplicates --------------------------------------------------------------

def drop_boilerplate(docs, min_docs=5, share=0.02):
    """Drops paragraphs that occur in at least max(min_docs, share * #docs) documents of the list
    (navigation, licence footers, 'Previous topic' ...)."""
    counts = Counter(p for _, paras in docs for p in set(paras))
    limit = max(min_docs, share * len(docs))
    return [(i, [p for p in paras if counts[p] < limit]) for i, paras in docs], \
        sum(1 for c in counts.values() if c >= limit)


def shingle_sketch(text, k=64, n=5):
    """The k smallest 32-bit hashes of the word n-grams of `text` (bottom-k MinHash sketch)."""
    words = text.lower().split()
    if len(words) < n:
        return frozenset([zlib.crc32(' '.join(words).encode())])
    hashes = {zlib.crc32(' '.join(words[i:i + n]).encode()) for i in range(len(words) - n + 1)}
    return frozenset(sorted(hashes)[:k])


def sketch_similarity(a, b, k=64):
    """Estimated Jaccard similarity of two documents from their bottom-k sketches."""
    union = sorted(a | b)[:k]
    return sum(1 for h in union if h in a and h in b) / len(union)


class Deduplicator:
    """Exact (SHA-1 of the normalized text) and near duplicates (sketch similarity >= threshold with
    an earlier kept document sharing one of its 4 smallest hashes). First seen wins."""

    def __init__(self, threshold=0.8):
        self.threshold = threshold
        self.exact = set()
        self.sketches = []
        self.index = {}

    def check(self, text):
        """'exact', 'near' or None (new: remembered)."""
        digest = hashlib.sha1(normalize_space(text).lower().encode()).digest()
        if digest in self.exact:
            return 'exact'
        sketch = shingle_sketch(text)
        smallest = sorted(sketch)[:4]
        candidates = {j for h in smallest for j in self.index.get(h, ())}
        for j in sorted(candidates):
            if sketch_similarity(sketch, self.sketches[j]) >= self.threshold:
                return 'near'
        self.exact.add(digest)
        idx = len(self.sketches)
        self.sketches.append(sketch)
        for h in smallest:
            self.index.setdefault(h, []).append(idx)
        return None


def is_validation(doc_id, val_fraction):
    """Deterministic split by document: the first 8 bytes of SHA-256(id) as a fraction of 2^64."""
    h = int.from_bytes(hashlib.sha256(doc_id.encode()).digest()[:8], 'big')
    return h < val_fraction * 2.0 ** 64


def clean_package(pkg, root, dedup, min_doc_bytes=400):
    docs = package_documents(pkg, root)
    docs, boiler = drop_boilerplate(docs)
    stats = Counter(files=len(docs), boilerplate_paragraphs=boiler)
    kept = []
    for doc_id, paras in docs:
        text = '\n'.join(paras)
        if len(text.encode()) < min_doc_bytes:
            stats['short'] += 1
            continue
        verdict = dedup.check(text)
        if verdict:
            stats[verdict + '_duplicates'] += 1
            continue
        kept.append((doc_id, text))
    return kept, stats


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument('--root', required=True, help='folder with one extracted package per subfolder')
    ap.add_argument('--out', required=True, help='output folder: train.txt, val.txt, stats.json')
    ap.add_argument('--packages', nargs='*', default=None, help='default: every known package found under --root')
    ap.add_argument('--val-fraction', type=float, default=0.02)
    args = ap.parse_args(argv)
    pkgs = args.packages or [p for p in SOURCES if os.path.isdir(os.path.join(args.root, p))]
    unknown = [p for p in pkgs if p not in SOURCES]
    if unknown:
        print(f'clean.py: no extraction rule for {", ".join(unknown)}', file=sys.stderr)
        return 2
    os.makedirs(args.out, exist_ok=True)
    dedup = Deduplicator()
    report = {}
    with open(os.path.join(args.out, 'train.txt.tmp'), 'w', encoding='utf-8') as train, \
            open(os.path.join(args.out, 'val.txt.tmp'), 'w', encoding='utf-8') as val:
        for pkg in pkgs:
            root = os.path.join(args.root, pkg)
            if not os.path.isdir(root):
                print(f'clean.py: {root} missing (extract the package first)', file=sys.stderr)
                return 1
            kept, stats = clean_package(pkg, root, dedup)
            for doc_id, text in kept:
                side = 'val' if is_validation(doc_id, args.val_fraction) else 'train'
                (val if side == 'val' else train).write(text + '\n\n')
                stats[side + '_documents'] += 1
                stats[side + '_bytes'] += len(text.encode()) + 2
            report[pkg] = dict(stats)
            print(f'{pkg}: {json.dumps(report[pkg])}', file=sys.stderr, flush=True)
    for side in ('train', 'val'):
        os.replace(os.path.join(args.out, side + '.txt.tmp'), os.path.join(args.out, side + '.txt'))
    with open(os.path.join(args.out, 'stats.json'), 'w') as f:
        json.dump(report, f, indent=1, sort_keys=True)
    return 0


if __name__ == '__main__':
    sys.exit(main())
