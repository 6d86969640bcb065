// The cost of a kernel boundary in a captured graph: kernels that do nothing but wait for the one before
// (PDL), add to a counter and let the next start. dev/boundary_probe.py times chains of them.
extern "C" __global__ void hop(unsigned* count) {
    asm volatile("griddepcontrol.wait;" ::: "memory");
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
    if (threadIdx.x == 0) atomicAdd(count + blockIdx.x, 1u);
}
