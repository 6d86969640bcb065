// What cold instruction fetch costs a kernel: OPS straight-line FADDs in four chains (16 bytes of code
// each), after the PDL wait. dev/icache_probe.py chains launches of one such kernel, or of several
// copies (separate modules, so separate code), in a graph.
#ifndef OPS
#define OPS 256
#endif
#ifndef SALT
#define SALT 0
#endif
extern "C" __global__ void big(float* out, unsigned* count) {
    asm volatile("griddepcontrol.wait;" ::: "memory");
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
    float a = threadIdx.x + SALT, b = a + 1.f, c = a + 2.f, d = a + 3.f;
    const float k = 1.0f + 1e-3f * SALT;
#pragma unroll
    for (int i = 0; i < OPS / 4; ++i) {
        asm volatile("add.f32 %0, %0, %1;" : "+f"(a) : "f"(k));
        asm volatile("add.f32 %0, %0, %1;" : "+f"(b) : "f"(k));
        asm volatile("add.f32 %0, %0, %1;" : "+f"(c) : "f"(k));
        asm volatile("add.f32 %0, %0, %1;" : "+f"(d) : "f"(k));
    }
    if (a + b + c + d == -1.f) out[threadIdx.x] = a;  // never true: keeps the chains
    if (threadIdx.x == 0) atomicAdd(count + blockIdx.x, 1u);
}
