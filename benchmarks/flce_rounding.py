"""The weight gradient's rounding in the fused loss: one matmul over all tokens against a bf16 sum
over K token chunks. Relative error of grad W against float64, bf16 roundings emulated in fp32
matmuls (bf16 matmuls on a CPU are slow; the fp32 accumulator of a GPU matmul is what they model).

    python benchmarks/flce_rounding.py

One rounding is what eager torch and the fused loss's weight pass do (g rounded to bf16, grad W =
g.T @ h over all tokens, rounded once); the K-chunk sum is Liger's (acc = bf16(acc + g_k.T @ h_k)).
"""
import torch


def main(n=2048, hidden=128, vocab=4008):
    torch.manual_seed(0)
    bf = lambda t: t.to(torch.bfloat16).float()  # noqa: E731
    h = bf(torch.randn(n, hidden))
    w = bf(torch.randn(vocab, hidden) / hidden ** 0.5 * 2)
    y = torch.randint(0, vocab, (n,))
    hd, wd = h.double().requires_grad_(), w.double().requires_grad_()
    torch.nn.functional.cross_entropy(hd @ wd.T, y).backward()
    ref = wd.grad
    p = torch.softmax(bf(h @ w.T), 1)
    p[torch.arange(n), y] -= 1
    g = bf(p / n)

    def err(x):
        return ((x.double() - ref).norm() / ref.norm()).item()

    print(f"{n} tokens x {hidden} hidden x {vocab} vocabulary, grad W relative error against float64")
    print(f"  one matmul, one rounding (eager; the weight pass): {err(bf(g.T @ h)):.2e}")
    for k in (4, 8, 16, 32):
        acc = torch.zeros(vocab, hidden)
        for c in range(k):
            s = slice(c * n // k, (c + 1) * n // k)
            acc = bf(acc + g[s].T @ h[s])
        print(f"  bf16 sum over {k} token chunks: {err(acc):.2e}")


if __name__ == "__main__":
    main()
