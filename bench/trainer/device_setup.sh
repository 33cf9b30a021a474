# Set-up on a GPU machine without a package index (sourced by the commands in README.md):
# wheels carried in .whl/ (trl, datasets, dill, multiprocess, bitsandbytes, liger-kernel,
# pydantic, pydantic-core, pydantic-settings, typing-inspection, annotated-types,
# typing_extensions, python-dotenv, tenacity), then lorastack itself with its entry points.
python3 -m pip install -q --no-index --no-deps --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
python3 -m pip install -q --no-deps --no-build-isolation --no-index --upgrade --target /tmp/site libs/lorastack services/trainer apps/lorastack || exit 1
export PYTHONPATH=/tmp/site PATH=/tmp/site/bin:$PATH PYTHONUNBUFFERED=1
# that machine's torch install is read-only and has no bytecode: every process (each arm's,
# the compile-ahead child's) compiled ~1,000 modules again, 5.5 s of one data preparation
# (bench/trainer/results/2026-12-02-2ad28f6.json); kept here between processes, as an
# installed package keeps its .pyc files, for every arm alike
export PYTHONPYCACHEPREFIX=/tmp/pycache
# ... which that machine's environment forbids (PYTHONDONTWRITEBYTECODE): without this every
# process compiled ~4,700 modules from source again (a cProfile of `lorastack train` there,
# session 13: 15 s in compile()); written once here, by one import of what the arms use
unset PYTHONDONTWRITEBYTECODE
python3 -c "import torch._dynamo, torch._inductor.compile_fx, transformers, peft, bitsandbytes, matplotlib.pyplot, trainer.cli, trainer.recipe, trainer.assembly" || exit 1
python3 -c "import trl, liger_kernel, datasets" 2>/dev/null
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
python3 -c "import torch, transformers, peft, trl, bitsandbytes; print(torch.__version__, transformers.__version__, peft.__version__, trl.__version__, bitsandbytes.__version__)"
