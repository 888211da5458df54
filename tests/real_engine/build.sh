#!/usr/bin/env bash
# Build llama.cpp's llama-server from source, CPU only, for tests/features/test_real_engine.py.
#
# The source is the llama.cpp vendored in the llama-cpp-python sdist on PyPI
# (an ordinary `pip download`, no git clone); nothing else is downloaded:
# no model (the test writes its own), no prebuilt web UI, no curl/OpenSSL.
#
#   tests/real_engine/build.sh [BUILD_DIR]     (default /tmp/llama-build)
#   SWTEST_REAL_ENGINE=$(tests/real_engine/build.sh | tail -1) pytest tests/features/test_real_engine.py
#
# Env: PYTHON (default: python3), LLAMA_CPP_PYTHON_VERSION (default: 0.3.36,
# the version measured: ~12 min with -j2 on a 2-core machine), JOBS (default 2).
set -euo pipefail

BUILD_DIR=${1:-/tmp/llama-build}
PYTHON=${PYTHON:-python3}
VERSION=${LLAMA_CPP_PYTHON_VERSION:-0.3.36}
JOBS=${JOBS:-2}

mkdir -p "$BUILD_DIR"
cd "$BUILD_DIR"
sdist="llama_cpp_python-$VERSION.tar.gz"
if [ ! -f "$sdist" ]; then
    "$PYTHON" -m pip download "llama-cpp-python==$VERSION" --no-binary :all: --no-deps -d . >&2
fi
src="$BUILD_DIR/llama_cpp_python-$VERSION/vendor/llama.cpp"
[ -d "$src" ] || tar xzf "$sdist"

cmake -S "$src" -B build -G "$(command -v ninja >/dev/null && echo Ninja || echo 'Unix Makefiles')" \
    -DCMAKE_BUILD_TYPE=Release \
    -DGGML_NATIVE=OFF \
    -DLLAMA_CURL=OFF \
    -DLLAMA_OPENSSL=OFF \
    -DLLAMA_BUILD_SERVER=ON \
    -DLLAMA_BUILD_TESTS=OFF \
    -DLLAMA_BUILD_EXAMPLES=OFF \
    -DLLAMA_USE_PREBUILT_UI=OFF \
    -DBUILD_SHARED_LIBS=OFF >&2
cmake --build build -j"$JOBS" --target llama-server >&2

binary="$BUILD_DIR/build/bin/llama-server"
"$binary" --version >&2
echo "$binary"
