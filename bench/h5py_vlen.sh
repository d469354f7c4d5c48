#!/usr/bin/env bash
# h5py's variable-length files, read by two imagefeed-bench builds side by side, alternating.
#   bench/h5py_vlen.sh OLD_BENCH NEW_BENCH [DATA] [WORK] [ROUNDS]
# DATA (default ../shared/data) holds cifar10-test.tar.gz and imagenet-sample-200.tar; WORK
# (default /tmp/h5py-vlen) receives the trees and, written by h5py the way training scripts
# do (`create_dataset(..., dtype=h5py.vlen_dtype(np.uint8))`, one element per file, int64
# labels, a `classes` attribute), cifar-vlen.h5 (the 10,000 CIFAR-10 test images) and
# imagenet-vlen.h5 (the 200 photos x 25). PYTHON (default .venv/bin/python) needs h5py.
# Prints one line per measurement: what, arm, median images/s of the epochs after warm-up.
set -euo pipefail
old=$(realpath "$1"); new=$(realpath "$2")
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
data=$(realpath "${3:-$root/../shared/data}"); work=${4:-/tmp/h5py-vlen}; rounds=${5:-3}
python=${PYTHON:-$root/.venv/bin/python}
mkdir -p "$work" && cd "$work"
[ -d cifar10-test ] || tar -xzf "$data/cifar10-test.tar.gz"
if [ ! -d imagenet-x25 ]; then
  tar -xf "$data/imagenet-sample-200.tar"
  (cd imagenet-sample-200 && find . -type f) | while read -r f; do
    for i in $(seq -w 1 25); do
      mkdir -p "imagenet-x25/$(dirname "$f")"
      ln -f "imagenet-sample-200/$f" "imagenet-x25/${f%.*}-$i.${f##*.}"
    done
  done
fi
"$python" - <<'PY'
import os, h5py, numpy as np
def write(src, out):
    if os.path.exists(out):
        return
    classes = sorted(e.name for e in os.scandir(src) if e.is_dir())
    samples = [(os.path.join(src, c, f), l) for l, c in enumerate(classes)
               for f in sorted(os.listdir(os.path.join(src, c)))]
    with h5py.File(out + ".tmp", "w") as f:
        d = f.create_dataset("images", (len(samples),), dtype=h5py.vlen_dtype(np.uint8))
        for k, (p, _) in enumerate(samples):
            d[k] = np.frombuffer(open(p, "rb").read(), np.uint8)
        f.create_dataset("labels", data=np.array([l for _, l in samples], np.int64))
        f.attrs["classes"] = classes
    os.replace(out + ".tmp", out)
write("cifar10-test", "cifar-vlen.h5")
write("imagenet-x25", "imagenet-vlen.h5")
PY
med() { sort -n | awk '{a[NR]=$1} END {print (NR%2 ? a[(NR+1)/2] : (a[NR/2]+a[NR/2+1])/2)}'; }
rate() { grep -v 'epoch 0' | grep -o '[0-9]* images/s' | awk '{print $1}' | med; }
echo "== $(date -u +%FT%TZ) $(nproc) cores; old $old, new $new"
for round in $(seq "$rounds"); do
  for arm in old new; do
    B=$old; [ "$arm" = new ] && B=$new
    echo "cifar-vlen-load-w2 $arm $("$B" load cifar-vlen.h5 --batch-size 256 --workers 2 --epochs 8 --warmup 1 --transform cifar 2>&1 | rate)"
    echo "cifar-vlen-read-t2 $arm $("$B" read cifar-vlen.h5 --threads 2 --epochs 4 2>&1 | rate)"
    echo "imagenet-vlen-rrc-w2 $arm $("$B" load imagenet-vlen.h5 --batch-size 64 --workers 2 --epochs 3 --warmup 1 --transform imagenet 2>&1 | rate)"
  done
done
