// bf16 GEMV for one token: the shared streaming loop and epilogues of gemv_core.cuh over rows of
// K bf16 weights (16-byte chunks of 8). ROWS rows per warp share each x load: 2 for a large lm_head,
// 4 for many short rows (a small model's lm_head); EPI_SILU and EPI_ROPE pair their rows.
// budget: gemv=128 gemv_rope=128
// defines: K=4096 EPILOGUE=EPI_STORE NORM=1 BIAS=1
// defines: K=14336 EPILOGUE=EPI_ADD NORM=0 BIAS=0 SPLIT_K=4
// defines: K=4096 EPILOGUE=EPI_SILU NORM=1 BIAS=0
// defines: K=576 EPILOGUE=EPI_STORE NORM=1 BIAS=0 ARGMAX=1
// defines: K=896 EPILOGUE=EPI_STORE NORM=1 BIAS=0 ARGMAX=1 ROWS=4 WARPS=4 MIN_BLOCKS=4
// defines: K=72 EPILOGUE=EPI_STORE NORM=0 BIAS=1 ROWS=4
// defines: K=64 EPILOGUE=EPI_SILU NORM=1 BIAS=0
// defines: K=4096 EPILOGUE=EPI_ROPE NORM=1 BIAS=0 HEAD_DIM=128 SPLIT_K=2 WARPS=4 MIN_BLOCKS=4
// defines: K=14336 EPILOGUE=EPI_ADD NORM=0 BIAS=0 SPLIT_K=2 WARPS=4 MIN_BLOCKS=4
// defines: K=4096 EPILOGUE=EPI_SILU NORM=1 BIAS=0 WARPS=4 MIN_BLOCKS=4
// defines: K=4096 EPILOGUE=EPI_STORE NORM=1 BIAS=0 ARGMAX=1 ROWS=2 WARPS=4 MIN_BLOCKS=4
// defines: K=4096 EPILOGUE=EPI_ADD NORM=0 BIAS=1 ROWS=2 SPLIT_K=2 WARPS=4 MIN_BLOCKS=4
// defines: K=4096 EPILOGUE=EPI_GATE NORM=1 BIAS=1 WARPS=4 MIN_BLOCKS=4
// defines: K=896 EPILOGUE=EPI_ROPE NORM=1 BIAS=1 HEAD_DIM=64
// defines: K=64 EPILOGUE=EPI_ROPE NORM=1 BIAS=1 HEAD_DIM=16
#define FORMAT Bf16
#define KERNEL_SUFFIX
#include "gemv_kernels.cuh"
