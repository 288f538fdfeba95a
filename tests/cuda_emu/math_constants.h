// The constants of CUDA's math_constants.h that TVM's CUDA code generation uses, for the CPU emulator.
#pragma once
#include <cmath>
#define CUDART_INF_F INFINITY
#define CUDART_NAN_F NAN
#define CUDART_INF ((double)INFINITY)
#define CUDART_NAN ((double)NAN)
