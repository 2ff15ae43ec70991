#!/usr/bin/env bash
# Build llama.cpp's own `llama-server` from the llama.cpp that the installed llama-cpp-python
# vendors, so that benchmarks compare our server with its peer built from the same kernels.
#
#   tools/build_llama_server.sh [OUT_DIR]     (default: /tmp/llama-server)
#
# It downloads the llama-cpp-python sdist of the installed version from PyPI (no other source),
# configures its vendor/llama.cpp with CMake for this CPU (GGML_NATIVE, as pip's source build
# does) and builds the `llama-server` target only: about 15 minutes on 2 cores. The binary is
# OUT_DIR/build/bin/llama-server; nothing is installed or committed.
set -euo pipefail
out="${1:-/tmp/llama-server}"
python="${PYTHON:-python3}"
version="$("$python" -c 'import importlib.metadata as m; print(m.version("llama-cpp-python"))')"
mkdir -p "$out"
cd "$out"
if [ ! -d "llama_cpp_python-$version" ]; then
    "$python" -m pip download --no-binary :all: --no-deps -d . "llama-cpp-python==$version"
    tar xzf "llama_cpp_python-$version.tar.gz"
fi
src="$out/llama_cpp_python-$version/vendor/llama.cpp"
[ -f "$src/CMakeLists.txt" ] || { echo "no vendored llama.cpp in the sdist at $src" >&2; exit 1; }
cmake -S "$src" -B "$out/build" -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON -DLLAMA_CURL=OFF \
    -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=ON >/dev/null
cmake --build "$out/build" --target llama-server -j "$(nproc)"
echo "$out/build/bin/llama-server (llama.cpp vendored by llama-cpp-python $version)"
