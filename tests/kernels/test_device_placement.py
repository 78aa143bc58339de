"""Every tensor a device-parameterized kernel test builds names its device.

A kernel test that takes the `device` fixture (or a helper that takes a `device` argument) runs
on cpu here and on cuda on a GPU machine (ACCEL_TEST_DEVICE=cuda). Here the default device is the
test device, so `torch.randn(shape)` works by accident; on the GPU machine it lands on the CPU and
the test fails there ("expected device cuda:0 but got cpu"), or quietly checks the CPU. This reads
the test sources (no test runs) and fails on every tensor constructor in such a function without
`device=` (or a `with torch.device(device):` block around it): the bug is caught on this machine, in every branch, including the CUDA-only ones this
machine never executes. `device="cpu"` (a CPU tensor on purpose, e.g. one random stream so that
every device gets the same inputs, moved with `.to(device)`) is allowed with a comment on its line
saying why.

Out of reach of a source read: a helper without a `device` argument that builds tensors for a
device test (build them from the test's tensors, `*_like` or `.new_*`, instead), and modules
constructed in a test (move them with `.to(device)`).

Rejected alternative: running the tests with `torch.set_default_device("meta")` on CPU. It flags
what would work on a GPU too (a CPU 0-dim tensor beside cuda ones; transformers modules whose
buffers are built on the default device, then moved), fails with "Cannot copy out of meta tensor"
far from the line at fault, and never runs the branches a CPU skips.
"""
from __future__ import annotations

import ast
import io
import pathlib
import tokenize

HERE = pathlib.Path(__file__).parent

#: torch functions that build a tensor (or generator) on the default device unless given device=
CONSTRUCTORS = frozenset({
    "arange", "as_tensor", "empty", "empty_strided", "eye", "full", "Generator", "linspace", "logspace",
    "ones", "rand", "randint", "randn", "randperm", "range", "tensor", "zeros",
})


def _is_cpu(node: ast.expr) -> bool:
    """`"cpu"` or `torch.device("cpu")`."""
    if isinstance(node, ast.Constant):
        return node.value == "cpu"
    return _is_device_call(node) and len(node.args) == 1 and _is_cpu(node.args[0])


def _is_device_call(node: ast.expr) -> bool:
    return (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "device"
            and isinstance(node.func.value, ast.Name) and node.func.value.id == "torch")


def _commented_lines(source: str) -> set[int]:
    tokens = tokenize.generate_tokens(io.StringIO(source).readline)
    return {tok.start[0] for tok in tokens if tok.type == tokenize.COMMENT}


def _takes_device(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> bool:
    args = fn.args
    return any(a.arg == "device" for a in args.posonlyargs + args.args + args.kwonlyargs)


def off_device_constructors(source: str, filename: str = "<test>") -> list[str]:
    """'file:line: torch.<name>(...) without device= in <function>' for every constructor, in a
    function that takes `device` (and the functions nested in it), that names no device, or names
    cpu with no comment on its line."""
    tree = ast.parse(source, filename)
    commented = _commented_lines(source)
    found: list[str] = []

    def visit(node: ast.AST, owner: str | None) -> None:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and owner is None and _takes_device(node):
            owner = node.name
        placing = [item.context_expr for item in node.items if _is_device_call(item.context_expr)] \
            if isinstance(node, ast.With) else []
        if owner is not None and placing:
            if any(_is_cpu(p) for p in placing) and node.lineno not in commented:
                found.append(f"{filename}:{node.lineno}: with torch.device('cpu') in {owner} "
                             f"without a comment saying why the CPU")
            owner = None  # `with torch.device(...):` names the device of everything built inside
        if owner is not None and isinstance(node, ast.Call):
            func = node.func
            if (isinstance(func, ast.Attribute) and func.attr in CONSTRUCTORS and isinstance(func.value, ast.Name)
                    and func.value.id == "torch"):
                device = next((k.value for k in node.keywords if k.arg == "device"), None)
                unpacked = any(k.arg is None for k in node.keywords)  # **kwargs: may carry it
                lines = set(range(node.lineno, (node.end_lineno or node.lineno) + 1))
                if device is None and not unpacked:
                    found.append(f"{filename}:{node.lineno}: torch.{func.attr}(...) without device= in {owner}")
                elif device is not None and _is_cpu(device) and not lines & commented:
                    found.append(f"{filename}:{node.lineno}: torch.{func.attr}(..., device='cpu') in {owner} "
                                 f"without a comment saying why the CPU")
        for child in ast.iter_child_nodes(node):
            visit(child, owner)

    visit(tree, None)
    return found


def test_device_tests_build_every_tensor_on_their_device():
    found = [line for path in sorted(HERE.glob("*.py"))
             for line in off_device_constructors(path.read_text(), path.name)]
    assert not found, "tensors built off the test device (pass device=device):\n" + "\n".join(found)


def test_the_check_sees_what_it_must_and_passes_what_it_may():
    flagged = off_device_constructors('''
def test_a(device):
    x = torch.randn(3, device=device)
    g = torch.randn(x.shape).to(x.dtype)
    def inner():
        return torch.zeros(2)
    torch.full((2,), 1.0, device="cpu")
    torch.ones(2, device="cpu")  # one stream for every device
    torch.tensor([1], **kw)
    if device.type == "cuda":
        torch.Generator()
    with torch.device(device):
        torch.randn(2)
    with torch.device("cpu"):
        torch.randn(2)

def make(n, device="cpu"):
    return torch.arange(n).to(device)

def test_cpu_only():
    return torch.randn(3)
''')
    assert [line.split(": ", 1)[1] for line in flagged] == [
        "torch.randn(...) without device= in test_a",
        "torch.zeros(...) without device= in test_a",
        "torch.full(..., device='cpu') in test_a without a comment saying why the CPU",
        "torch.Generator(...) without device= in test_a",
        "with torch.device('cpu') in test_a without a comment saying why the CPU",
        "torch.arange(...) without device= in make",
    ]
