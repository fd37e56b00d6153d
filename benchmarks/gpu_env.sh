# Source this on a GPU machine before the benchmarks: puts the repository on PYTHONPATH and,
# when the anchor wheels were carried along (.anchors/wheels, .anchors/stubs: a copy of the
# anchor wheels (tokamax) carried to the GPU machine, kept out of git), installs them
# (tokamax and its pure-Python dependencies) into a scratch site and adds it and the xprof
# stub too. Prints whether tokamax imports, so a run without the anchor is visible at once.
_root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
export PYTHONPATH="$_root${PYTHONPATH:+:$PYTHONPATH}"
if [ -d "$_root/.anchors/wheels" ]; then
  _site=${ANCHOR_SITE:-/tmp/magi-anchor-site}
  python3 -m pip install -q --no-index --no-deps --target "$_site" "$_root"/.anchors/wheels/*.whl \
    >/dev/null 2>&1 || echo "gpu_env: installing the anchor wheels into $_site failed" >&2
  export PYTHONPATH="$PYTHONPATH:$_site:$_root/.anchors/stubs"
fi
python3 -c "import tokamax" 2>/dev/null && echo "gpu_env: tokamax imports" \
  || echo "gpu_env: tokamax does not import (no tokamax columns)" >&2
unset _root _site
