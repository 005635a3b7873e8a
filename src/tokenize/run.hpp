// tokenize/run.hpp — ptrain-tokenize: text files or JSON lines to one Megatron indexed dataset
// (data/indexed.hpp), MPI-parallel over the input files.
//
//   mpirun -np N ptrain-tokenize --output PREFIX
//       (--gpt2-encoder encoder.json --gpt2-merges vocab.bpe | --sentencepiece MODEL)
//       [--json-key text] [--eod ID] [--overwrite] FILE...
//
// A file named *.jsonl or *.json holds a JSON object per line, the document in its string
// member --json-key (blank lines skipped); any other file is one document of text. Every
// document's ids get the end-of-document id appended (the tokenizer's <|endoftext|> or </s>,
// or --eod). Each rank tokenizes whole files (the largest first, each to the least loaded
// rank) into a part file beside the output; then the ranks write one PREFIX.bin in the order
// of the input files (MPI-IO, each at its files' offsets) and rank 0 the index, as
// PREFIX.bin.tmp and PREFIX.idx.tmp checked and renamed into place. An existing PREFIX.bin or
// .idx is refused unless --overwrite. Tokens are uint16 below a vocabulary of 65500, else
// int32 (Megatron's rule). It reports documents, tokens and MB/s of text.
//
// Errors (arguments, unreadable or malformed input naming the file and line, an existing
// output) are one line from rank 0 and exit code 2, the same on every rank.
#pragma once
#include <mpi.h>

namespace ptrain::tokenize {

// The whole tool, collective over comm; returns the exit code (0), throws Error otherwise.
int run(int argc, char** argv, MPI_Comm comm);

}  // namespace ptrain::tokenize
