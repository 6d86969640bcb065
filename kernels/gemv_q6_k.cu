// Q6_K GEMV (6.5625 bits per weight): the shared streaming loop and epilogues of gemv_core.cuh over
// rows of Q6_K blocks repacked at load (kernels/quant_layout.py); ROWS rows per warp share x.
// budget: gemv_q6_k=168 gemv_rope_q6_k=168
// defines: K=4096 EPILOGUE=EPI_STORE NORM=1 BIAS=0 ARGMAX=1 ROWS=4 WARPS=4 MIN_BLOCKS=3 X_SMEM=1
// defines: K=4096 EPILOGUE=EPI_ROPE NORM=1 BIAS=1 HEAD_DIM=128 ROWS=4 SPLIT_K=2 WARPS=4 MIN_BLOCKS=3 X_SMEM=1
// defines: K=4096 EPILOGUE=EPI_SILU NORM=1 BIAS=0 ROWS=4 WARPS=4 MIN_BLOCKS=3 X_SMEM=1
// defines: K=14336 EPILOGUE=EPI_ADD NORM=0 BIAS=1 ROWS=4 SPLIT_K=2 WARPS=4 MIN_BLOCKS=3 X_SMEM=1
// defines: K=4096 EPILOGUE=EPI_GATE NORM=1 BIAS=0 ROWS=4 WARPS=4 MIN_BLOCKS=3 X_SMEM=1
#define FORMAT Q6_K
#define KERNEL_SUFFIX _q6_k
#include "gemv_kernels.cuh"
