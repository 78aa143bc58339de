#!/usr/bin/env bash
# The packages the GPU image lacks, as wheels in the git-ignored .whl/, for a GPU call to carry
# (`carry: [".whl"]`); benchmarks/gpu_check.sh installs them with --no-deps into /tmp/site, after
# the image's own packages on PYTHONPATH, so that none of them shadows the image's torch or numpy.
#
#   bash benchmarks/fetch_wheels.sh        # here, where the registry answers; prints the total size
#
# The image (torch 2.11, transformers 5.17, peft 0.21, numpy 2.5, pandas, pyarrow, fsspec, xxhash,
# aiohttp: /work/.library/device/KINDS.md) lacks: liger-kernel (the comparison columns),
# bitsandbytes (QLoRA), trl and what trl needs beyond the image: datasets, and datasets' dill and
# multiprocess. Python 3.12 on x86-64 there; one version of each (two stop the install).
set -eu
cd "$(dirname "$0")/.."
WHEELS=(
    liger-kernel==0.8.5
    bitsandbytes==0.50.2   # 41 MB, manylinux_2_24
    trl==1.16.0
    datasets==5.2.0        # trl 1.16 wants >= 4.7; the version its tests here run with
    dill==0.4.1            # datasets 5.2: dill < 0.4.2
    multiprocess==0.70.19  # datasets 5.2: multiprocess < 0.70.20
)
mkdir -p .whl
for w in "${WHEELS[@]}"; do
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64 \
        --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform any -d .whl "$w" 2>&1 \
        | grep -v "is ignored: it is neither a file nor a directory" || true
done
ls -l .whl
tree_kib=$(git ls-files -z | du -c --files0-from=- -k | tail -n1 | cut -f1)
whl_kib=$(du -sk .whl | cut -f1)
echo "fetch_wheels: .whl ${whl_kib} KiB + tracked tree ${tree_kib} KiB = $(( (whl_kib + tree_kib) / 1024 )) MiB (limit 64 MiB)"
