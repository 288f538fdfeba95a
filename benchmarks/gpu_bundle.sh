#!/bin/bash
# Host side of the GPU check (benchmarks/notes/gpu22.md): what a GPU machine without TVM's compiler needs,
# in .gpu/ (ignored by git; name these paths in the device tool's carry):
#   .gpu/site.tar.xz  the installed tvm package without libtvm_compiler.so (runtime-only TVM, ~2.5 MB)
#   .gpu/whl/         apache-tvm-ffi for the GPU machine's Python (PYVER, default 3.12)
#   .gpu/art.tar.xz   gpu_check.py --build artifacts (CUDA, nvcc SASS) with their references
# then on the GPU machine: bash benchmarks/gpu_device.sh
# Usage: bash benchmarks/gpu_bundle.sh [gpu_check.py --build options, e.g. --corpus resnet18,gpt2 --bisect gpt2]
set -eu
PYVER=${PYVER:-3.12}
SITE=$(python -c "import tvm, os; print(os.path.dirname(os.path.dirname(tvm.__file__)))")
mkdir -p .gpu/whl
tar cJf .gpu/site.tar.xz -C "$SITE" --exclude=tvm/lib/libtvm_compiler.so --exclude=tvm/3rdparty \
    --exclude=tvm/src --exclude=tvm/web --exclude=tvm/include --exclude='__pycache__' tvm
FFI=$(python -c "import tvm_ffi; print(tvm_ffi.__version__)")
python -m pip download -q --no-deps --only-binary=:all: --python-version "$PYVER" --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 \
    -d .gpu/whl "apache-tvm-ffi==$FFI"
rm -rf .gpu/art
python benchmarks/gpu_check.py --build .gpu/art --sizes small "$@"
tar cf - -C .gpu art | xz -9 -T1 > .gpu/art.tar.xz
ls -la .gpu/site.tar.xz .gpu/whl .gpu/art.tar.xz
