#!/usr/bin/env bash
# Build llama.cpp's own command-line programs from the llama.cpp source that is
# vendored in llama-cpp-python's source package (same version as the installed
# llama_cpp module), so benchmarks can compare them with specdec.
#
# Idempotent: the source is fetched only if missing, cmake re-configures and
# re-builds incrementally. Everything lives under llama.cpp-src/ (git-ignored).
# Prints the bin directory on the last line.
#
# Usage: bash benchmarks/build_llama_cpp_tools.sh   (JOBS=N to change -j, default 2)
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
DEST="$ROOT/llama.cpp-src"
VERSION="$(python -c 'import llama_cpp; print(llama_cpp.__version__)')"
SRC="$DEST/llama_cpp_python-$VERSION/vendor/llama.cpp"
BUILD="$DEST/build"

# 1. Source: llama-cpp-python's sdist vendors the exact llama.cpp it was built against.
if [ ! -f "$SRC/CMakeLists.txt" ]; then
    mkdir -p "$DEST"
    pip download --no-binary :all: --no-deps "llama-cpp-python==$VERSION" -d "$DEST"
    tar -xzf "$DEST/llama_cpp_python-$VERSION.tar.gz" -C "$DEST"
fi

# 2. Configure. Static libs => self-contained binaries. No network (OpenSSL/curl),
#    no tests; the server for the load comparison (benchmarks/serve_load.py);
#    llama-completion is the non-interactive prompt -> text program.
cmake -S "$SRC" -B "$BUILD" -DCMAKE_BUILD_TYPE=Release \
    -DBUILD_SHARED_LIBS=OFF -DGGML_NATIVE=ON -DLLAMA_OPENSSL=OFF \
    -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_SERVER=ON -DLLAMA_BUILD_APP=OFF >/dev/null

# 3. Build only the programs we use.
cmake --build "$BUILD" -j "${JOBS:-2}" --target \
    llama-completion llama-speculative-simple llama-speculative llama-lookup llama-bench llama-server

echo "$BUILD/bin"
