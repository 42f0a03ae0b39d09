// Training text: the default public-domain corpus (the King James Bible of Debian's bible-kjv
// packages, extracted with the `bible` program as plain text, one verse per line, one blank
// line between books) and user-given text files. Text is split into documents at blank lines;
// shards.h tokenizes documents. Mirrors the "input.txt" of llm.c/nanoGPT, but from a package.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "core/status.h"

namespace nibble::train {

// The `bible` program and data file the default corpus comes from (scripts/setup.sh installs).
inline constexpr const char* kBibleProgram = "/usr/bin/bible";
inline constexpr const char* kBibleData = "/usr/lib/bible.data";

// The whole KJV (Genesis 1:1 .. Revelation 22:21) as plain text: verse text without the
// "Ge1:1 " references, one verse per line, books separated by one blank line (66 documents,
// about 4.3 MB). Error "default corpus not found: install bible-kjv ..." when missing.
Result<std::string> default_corpus_text();

// Writes default_corpus_text() to `path` (atomically) unless a non-empty file is already there.
Status write_default_corpus(const std::string& path);

// The bytes of a text file; missing, unreadable or empty files are errors naming the path.
Result<std::string> read_text_file(const std::string& path);

// Splits text into documents at blank lines (lines that are empty or only whitespace). Each
// document is a list of its lines without the trailing '\n'; documents are never empty.
std::vector<std::vector<std::string>> split_documents(const std::string& text);

// A seeded uniform sample of at most `max_lines` of the non-blank lines of `files` (reservoir
// sampling, algorithm R, with a SplitMix64 stream of `seed`), in reading order, read line by
// line so the files are never held whole: what the tokenizer of a multi-gigabyte corpus trains
// on. All lines when there are fewer. The same files and seed give the same sample anywhere.
// total_lines (optional): the number of non-blank lines seen.
Result<std::vector<std::string>> sample_lines(const std::vector<std::string>& files, int64_t max_lines, uint64_t seed,
                                              int64_t* total_lines = nullptr);

}  // namespace nibble::train
