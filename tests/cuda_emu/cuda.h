// Empty: the CUDA-on-CPU emulator (tests/cuda_emulator.py) compiles TVM's CUDA source with emu.h instead.
