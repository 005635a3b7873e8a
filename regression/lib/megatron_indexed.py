#!/usr/bin/python3
"""An independent writer of Megatron-LM's indexed dataset, for ptrain's reader tests.

  megatron_indexed.py DOCS PREFIX DTYPE

DOCS: a text file, one document a line, its tokens as numbers separated by blanks (an empty
line is an empty document). Writes PREFIX.bin and PREFIX.idx field by field as Megatron's
_IndexWriter and IndexedDatasetBuilder do (megatron/core/datasets/indexed_dataset.py): one
sequence per document, every sequence's tokens in .bin back to back; the index is
b"MMIDIDX\\x00\\x00", <Q version 1, <B dtype code, <Q sequence count, <Q document count
(documents + 1), int32 lengths, int64 byte pointers, int64 document indices (0, then the
sequence count after each document). DTYPE is a numpy name: uint8 int8 int16 int32 int64
float64 float32 uint16.
"""
import struct
import sys

import numpy as np

CODES = {"uint8": 1, "int8": 2, "int16": 3, "int32": 4, "int64": 5, "float64": 6,
         "float32": 7, "uint16": 8}


def main(docs_path, prefix, dtype_name):
    dtype = np.dtype(dtype_name).type
    with open(docs_path) as f:
        docs = [[float(t) if "." in t else int(t) for t in line.split()]
                for line in f.read().split("\n")[:-1]]
    lengths, indices = [], [0]
    with open(prefix + ".bin", "wb") as data:
        for doc in docs:
            data.write(np.array(doc, dtype=dtype).tobytes(order="C"))
            lengths.append(len(doc))
            indices.append(len(lengths))
    itemsize = np.dtype(dtype).itemsize
    pointers = np.concatenate([[0], np.cumsum(np.array(lengths, dtype=np.int64) * itemsize)[:-1]])
    with open(prefix + ".idx", "wb") as idx:
        idx.write(b"MMIDIDX\x00\x00")
        idx.write(struct.pack("<Q", 1))
        idx.write(struct.pack("<B", CODES[dtype_name]))
        idx.write(struct.pack("<Q", len(lengths)))
        idx.write(struct.pack("<Q", len(indices)))
        idx.write(np.array(lengths, dtype=np.int32).tobytes(order="C"))
        idx.write(np.array(pointers[:len(lengths)], dtype=np.int64).tobytes(order="C"))
        idx.write(np.array(indices, dtype=np.int64).tobytes(order="C"))


if __name__ == "__main__":
    main(*sys.argv[1:])
