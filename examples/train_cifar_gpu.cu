// The training kernels of examples/train_cifar_gpu.rs (softmax regression). Compiled to PTX by
// scripts/make_ptx.py (NVRTC, compute_70) and shipped as examples/train_cifar_gpu.ptx, as the
// library's own kernels are. Only builtins: no headers.

extern "C" {

// Softmax cross-entropy over row-major logits [n, classes] (one block per row):
// grad = (softmax - onehot) / n, and the row's loss / n is added to *loss.
__global__ void softmax_xent(const float *logits, const unsigned int *labels, int n, int classes,
                             float *grad, float *loss) {
    int row = blockIdx.x;
    if (row >= n || threadIdx.x != 0) return;
    const float *z = logits + (long long)row * classes;
    float *g = grad + (long long)row * classes;
    float m = z[0];
    for (int k = 1; k < classes; k++) m = fmaxf(m, z[k]);
    float sum = 0.f;
    for (int k = 0; k < classes; k++) sum += __expf(z[k] - m);
    unsigned int label = labels[row];
    for (int k = 0; k < classes; k++) {
        float p = __expf(z[k] - m) / sum;
        g[k] = (p - (k == (int)label ? 1.f : 0.f)) / n;
    }
    atomicAdd(loss, (logf(sum) + m - z[label]) / n);
}

// bias_grad[k] = sum over rows of grad[row, k] (row-major [n, classes]).
__global__ void column_sums(const float *grad, int n, int classes, float *bias_grad) {
    int k = blockIdx.x * blockDim.x + threadIdx.x;
    if (k >= classes) return;
    float s = 0.f;
    for (int r = 0; r < n; r++) s += grad[(long long)r * classes + k];
    bias_grad[k] = s;
}

// logits[row, k] += bias[k] (row-major [n, classes]).
__global__ void add_bias(float *logits, const float *bias, int n, int classes) {
    long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x;
    if (i >= (long long)n * classes) return;
    logits[i] += bias[i % classes];
}

// param -= lr * grad.
__global__ void sgd_step(float *param, const float *grad, long long len, float lr) {
    long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x;
    if (i < len) param[i] -= lr * grad[i];
}

}  // extern "C"
