#!/usr/bin/env bash
# Staging for the GPU compose walk (bench/compose/README.md), run HERE, where pip reaches
# PyPI and docker-compose 1.29 is installed: the wheels the device lacks beyond
# bench/serving's vLLM staging (.dev-serve), and the rendered GPU compose config.
#
#   bench/compose/stage.sh   -> .dev-compose/ (ignored by git), under 60 MiB
#     whl/site/  boto3 + botocore + s3transfer (the store client of every service) and moto's
#                server with what it needs that the device lacks (the S3 stand-in, minio-init)
#     whl/jobs/  what the trainer and merger images (and the gateway's) hold that the vLLM
#                staging does not: transformers 5.19.0 with huggingface_hub 2.4.0 (lorastack's
#                model import needs hub 2.x; the device's transformers 5.17 takes 1.x only),
#                bitsandbytes 0.50.2 cut to its CUDA 13 and CPU libraries (QLoRA)
#     render/    `docker-compose config` of compose.yaml + deploy/compose.gpu.yaml (+ the CI
#                stand-ins), with serve.yaml and with SERVE_CONFIG=serve-merged.yaml
set -euo pipefail
cd "$(dirname "$0")/../.."
root=.dev-compose
grep -qx '/.dev-compose/' .git/info/exclude 2>/dev/null || echo '/.dev-compose/' >> .git/info/exclude
mkdir -p "$root/whl/site" "$root/whl/jobs" "$root/download"  # download/: not carried
plat=(--platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64
      --platform manylinux2014_x86_64 --platform manylinux1_x86_64 --platform manylinux_2_24_x86_64)
pipdl() { python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp "${plat[@]}" -d "$1" "${@:2}"; }

# the CPU venv's versions (constraints.txt), moto as deploy/tests/standins/s3.Dockerfile pins it
pipdl "$root/whl/site" boto3==1.44.8 botocore==1.44.8 s3transfer==0.19.3 \
  moto==5.2.5 flask==3.1.3 flask-cors==6.0.5 werkzeug==3.1.9 xmltodict==1.0.4 responses==0.26.3 \
  cryptography==50.0.2 cffi==2.1.1 pycparser==3.12 blinker==1.9.0 itsdangerous==2.2.0
# what hub 2.4 needs (httpx2, click >= 8.4.2, hf-xet >= 1.6) and transformers 5.19 (regex >=
# 2025.10.22) at the CPU venv's versions rather than trusting the device's, ahead only in the
# jobs' path; its tokenizers (>= 0.23.1) the device has (0.23.2)
pipdl "$root/whl/jobs" transformers==5.19.0 huggingface_hub==2.4.0 \
  httpx2==2.16.2 httpcore2==2.16.2 truststore==0.10.5 click==8.5.1 hf-xet==1.8.0 idna==3.20 \
  anyio==4.16.0 h11==0.16.0 regex==2026.11.19

# bitsandbytes: only the CUDA 13.0 and CPU libraries (the device's torch is cu130)
if ! ls "$root"/whl/jobs/bitsandbytes-0.50.2-*.whl >/dev/null 2>&1; then
  pipdl "$root/download" bitsandbytes==0.50.2
  whl=$(ls "$root"/download/bitsandbytes-0.50.2-*.whl | head -1)
  python3 - "$whl" "$root/whl/jobs/$(basename "$whl")" <<'PY'
import base64, hashlib, re, sys, zipfile
src, dst = sys.argv[1], sys.argv[2]
keep = lambda n: not re.search(r"libbitsandbytes_(cuda|rocm|hip|xpu)", n) or "cuda130" in n
with zipfile.ZipFile(src) as zin, zipfile.ZipFile(dst, "w", zipfile.ZIP_DEFLATED) as zout:
    names = [n for n in zin.namelist() if keep(n)]
    record = next(n for n in names if n.endswith(".dist-info/RECORD"))
    rows = []
    for n in names:
        if n == record:
            continue
        data = zin.read(n)
        zout.writestr(n, data)
        digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
        rows.append(f"{n},sha256={digest},{len(data)}")
    zout.writestr(record, "\n".join([*rows, f"{record},,"]) + "\n")
    print("bitsandbytes kept:", [n for n in names if "libbitsandbytes" in n])
PY
fi
# the rendered config the walk reads on the device (new keys each time it is rendered)
.venv/bin/python bench/compose/walk.py --override gpu --phase render --render "$root/render"
du -sb "$root/whl" "$root/render"
s=$(du -sb "$root/whl" | cut -f1)
[ "$s" -lt $(( 60 * 1024 * 1024 )) ] || { echo "$root/whl is $s bytes: over 60 MiB" >&2; exit 1; }
