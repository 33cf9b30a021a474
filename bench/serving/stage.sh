#!/usr/bin/env bash
# Staging for the H200 serving check (bench/serving/README.md), run HERE, where pip reaches
# PyPI: the pinned CUDA vLLM 0.26.0 wheel (the newest whose torch pin, 2.11.0, matches the
# device; /work/shared/GPU-SERVING.md), trimmed of what a Hopper bf16 Llama never loads and
# split into two tar.xz parts under 64 MiB (one device call carries at most 64 MiB), and the
# Python dependencies the device image lacks as wheels for Python 3.12 x86_64.
#
#   bench/serving/stage.sh            -> .dev-serve/{part1,part2}/ (both ignored by git)
#
# Each carry folder must stay under 64 MiB with the working tree (~4 MB tracked) beside it.
set -euo pipefail
cd "$(dirname "$0")/../.."
root=.dev-serve
dl=$root/download
mkdir -p "$dl" "$root/part1" "$root/part2/whl"
grep -qx '/.dev-serve/' .git/info/exclude 2>/dev/null || echo '/.dev-serve/' >> .git/info/exclude

plat=(--platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64
      --platform manylinux2014_x86_64 --platform manylinux1_x86_64 --platform manylinux_2_31_x86_64
      --platform manylinux_2_24_x86_64 --platform manylinux_2_34_x86_64 --platform manylinux_2_35_x86_64)
pipdl() { python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp "${plat[@]}" -d "$1" "${@:2}"; }

# vLLM itself (290 MiB as a wheel)
[ -f "$dl"/vllm-0.26.0-*.whl ] || pipdl "$dl" vllm==0.26.0

# what the device image lacks (GPU-SERVING.md: found by importing vLLM's server, engine core,
# GPU model runner, Llama, LoRA worker manager and CLI in a venv holding the image's packages);
# the unpinned names there pinned here to what the CPU venv holds. xgrammar 0.2.6 with
# apache-tvm-ffi 0.1.10 (xgrammar >= 0.2.8 needs tvm-ffi >= 0.1.11). No boto3: the check's store is file:// (botocore alone is 17 MB).
deps=(fastapi==0.136.3 starlette==1.10.0 uvicorn==0.54.0 pydantic==2.14.4 pydantic-core==2.50.5
  typing-inspection==0.4.5 annotated-types==0.8.0 typing-extensions==4.16.0
  pydantic-settings==2.16.3 python-dotenv==1.2.4 tenacity==9.2.1 httptools==0.9.0
  openai==2.54.0 jiter==0.19.0 distro==1.9.0 sniffio==1.3.1 prometheus-fastapi-instrumentator==8.1.0
  lm-format-enforcer==0.11.3 interegular==0.3.3 llguidance==1.7.6 outlines_core==0.2.14 lark==1.2.2
  xgrammar==0.2.6 apache-tvm-ffi==0.1.10 partial-json-parser==0.2.1.1.post7 msgspec==0.23.0
  pyzmq==27.3.0 cbor2==6.3.0 pybase64==1.5.1 cachetools==8.0.2 openai-harmony==0.0.8
  model-hosting-container-standards==0.1.16 jmespath==1.1.0 supervisor==4.3.0 watchfiles==1.3.0
  python-json-logger==4.2.0 setproctitle==1.3.8 blake3==1.0.11 ijson==3.6.0 depyf==0.20.0
  astor==0.8.1 dill==0.4.1 compressed-tensors==0.17.0 loguru==0.7.3 opentelemetry-api==1.45.2
  jsonschema==4.26.0 jsonschema-specifications==2025.9.1 referencing==0.37.0 rpds-py==2026.9.1
  redis==8.1.0 dnspython==2.9.2)  # dnspython: the gateway's DNS discovery
rm -f "$root"/part2/whl/boto3-* "$root"/part2/whl/botocore-* "$root"/part2/whl/s3transfer-*
pipdl "$root/part2/whl" "${deps[@]}"

# trim and pack vLLM (GPU-SERVING.md's table: FA2, MoE kernels, the Rust front end, DeepGEMM
# and Blackwell FMHA; each import is guarded in 0.26)
if [ ! -f "$root/vllm.tar.xz" ]; then
  rm -rf "$root/unz" && mkdir -p "$root/unz"
  python3 -m zipfile -e "$dl"/vllm-0.26.0-*.whl "$root/unz"
  ( cd "$root/unz" && rm -rf vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so vllm/_moe_C_stable_libtorch.abi3.so \
      vllm/vllm-rs vllm/third_party/deep_gemm vllm/third_party/fmha_sm100 \
    && tar -cf - . | xz -6 -T2 > ../vllm.tar.xz )
  rm -rf "$root/unz"
fi
rm -f "$root"/part1/vllm.tar.xz.* "$root"/part2/vllm.tar.xz.*
# part 1: the first 50 MiB of vLLM; part 2: the rest beside the ~25 MB of wheels
split -b 50M -d -a 2 "$root/vllm.tar.xz" "$root/vllm.tar.xz."
mv "$root/vllm.tar.xz.00" "$root/part1/"
mv "$root/vllm.tar.xz.01" "$root/part2/"
# the SmolLM2 tokenizer (from `lorastack model import-default`; the tests leave one in .cache);
# `ls` exits 2 when one of the two places is missing, which pipefail would make fatal
tok=$(ls -d .cache/test-home/models/smollm2-* "${LORASTACK_HOME:-$HOME/.lorastack}"/models/smollm2-* 2>/dev/null | head -1 || true)
[ -n "$tok" ] || { echo "no SmolLM2 folder: run lorastack model import-default first" >&2; exit 1; }
mkdir -p "$root/part1/tokenizer"
cp "$tok"/tokenizer.json "$tok"/tokenizer_config.json "$tok"/chat_template.jinja "$root/part1/tokenizer/"
du -sb "$root/part1" "$root/part2"
for p in part1 part2; do
  s=$(du -sb "$root/$p" | cut -f1)
  [ "$s" -lt $(( 60 * 1024 * 1024 )) ] || { echo "$p is $s bytes: over 60 MiB" >&2; exit 1; }
done
