#!/usr/bin/env python3
"""Writes the compressed TFRecord fixtures with TensorFlow itself (tf.io.TFRecordWriter with
TFRecordOptions(compression_type=...)), as TensorFlow's ImageNet build script lays records out:
image/encoded, image/class/label = class index + 1, image/class/synset (the class folder),
image/class/text, image/filename, image/format.

fixtures/compat/tfrecord-gzip/train-0000{0,1}-of-00002.tfrecord.gz: GZIP, the first 8 files of
fixtures/imagefolder in ImageFolder order (4 per shard).
fixtures/compat/tfrecord-zlib/val-00000-of-00001: ZLIB, the same 8 files, no suffix (told by
content).

Needs tensorflow (not in make test's environment: a large download; run it by hand in a venv
with `pip install tensorflow-cpu`). The tests check these files against fixtures/imagefolder.
"""
import os
import shutil

import tensorflow as tf

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SRC = os.path.join(ROOT, "fixtures", "imagefolder")
OUT = os.path.join(ROOT, "fixtures", "compat")
EXTENSIONS = (".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".pgm", ".tif", ".tiff", ".webp")


def imagefolder(root):
    classes = sorted(e.name for e in os.scandir(root) if e.is_dir())
    samples = []
    for label, name in enumerate(classes):
        for dirpath, _, files in sorted(os.walk(os.path.join(root, name))):
            for f in sorted(files):
                if f.lower().endswith(EXTENSIONS):
                    samples.append((os.path.join(dirpath, f), label, name))
    return samples


def example(path, label, synset):
    data = open(path, "rb").read()
    feature = {
        "image/encoded": tf.train.Feature(bytes_list=tf.train.BytesList(value=[data])),
        "image/class/label": tf.train.Feature(int64_list=tf.train.Int64List(value=[label + 1])),
        "image/class/synset": tf.train.Feature(bytes_list=tf.train.BytesList(value=[synset.encode()])),
        "image/class/text": tf.train.Feature(bytes_list=tf.train.BytesList(value=[("the " + synset).encode()])),
        "image/filename": tf.train.Feature(bytes_list=tf.train.BytesList(value=[os.path.relpath(path, SRC).encode()])),
        "image/format": tf.train.Feature(bytes_list=tf.train.BytesList(value=[b"JPEG"])),
    }
    return tf.train.Example(features=tf.train.Features(feature=feature)).SerializeToString()


def write(directory, names, compression, samples):
    path = os.path.join(OUT, directory)
    shutil.rmtree(path, ignore_errors=True)
    os.makedirs(path)
    per = len(samples) // len(names)
    for n, name in enumerate(names):
        options = tf.io.TFRecordOptions(compression_type=compression)
        with tf.io.TFRecordWriter(os.path.join(path, name), options) as w:
            for sample in samples[n * per:(n + 1) * per]:
                w.write(example(*sample))


def main():
    samples = imagefolder(SRC)[:8]
    write("tfrecord-gzip", ["train-00000-of-00002.tfrecord.gz", "train-00001-of-00002.tfrecord.gz"], "GZIP", samples)
    write("tfrecord-zlib", ["val-00000-of-00001"], "ZLIB", samples)


if __name__ == "__main__":
    main()
