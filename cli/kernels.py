"""`gdecode kernels`: compile every kernels/*.cu and print per-kernel resource usage."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import List, Optional

import typer
from rich.console import Console
from rich.table import Table

from cli.main import app
from engine.errors import GDecodeError
from kernels.compiler import (
    KernelCompileError,
    check_arch,
    compile_kernel,
    declared_budgets,
    declared_defines,
    source_files,
)
from kernels.cuda import device_arch, gpu_available

DEFAULT_ARCH = "sm_90"


def _target_arch(arch: Optional[str]) -> str:
    if arch is None:
        arch = device_arch() if gpu_available() else DEFAULT_ARCH
    try:
        return check_arch(arch)
    except ValueError as e:
        raise GDecodeError(str(e)) from None


def _add_rows(table: Table, src: Path, defines: dict, arch: str, problems: list, logs: list):
    label = " ".join(f"{k}={v}" for k, v in defines.items())
    try:
        r = compile_kernel(src, defines=defines, arch=arch)
    except KernelCompileError as e:
        table.add_row(src.name, label, "[red]failed[/red]", "", "", "", "", "")
        problems.append(f"{src.name} {label}: compile failed")
        errors = [ln for ln in e.log.splitlines() if "error" in ln]
        logs.append("\n".join([str(e).splitlines()[0], *errors]))
        return
    budgets = declared_budgets(src)
    for name, s in sorted(r.stats.items()):
        budget = budgets.get(name)
        regs = f"{s.registers} / {budget if budget is not None else '-'}"
        if budget is None or s.registers > budget:
            regs = f"[red]{regs}[/red]"
            problems.append(f"{src.name} {label}: {name} uses {s.registers} registers, budget {budget}")
        table.add_row(src.name, label, name, regs, f"{s.smem} B", f"{s.stack} B",
                      f"{s.spill_stores}/{s.spill_loads}", "yes" if r.cached else "no")


@app.command("kernels")
def kernels(
    files: Optional[List[Path]] = typer.Argument(None, help="Kernel sources to compile (default: kernels/*.cu)."),
    arch: Optional[str] = typer.Option(
        None, "--arch", help="Target arch, e.g. sm_90 (default: this GPU's, else sm_90)."
    ),
):
    """Compile the CUDA kernels with NVRTC and show registers, shared memory, stack and spills."""
    arch = _target_arch(arch)
    sources = files or source_files()
    console = Console() if sys.stdout.isatty() else Console(width=160)
    if not sources:
        console.print("no kernel sources found")
        return
    table = Table(title=f"kernels for {arch}")
    for col in ("file", "defines", "kernel", "regs / budget", "smem", "stack", "spill st/ld", "cached"):
        table.add_column(col, justify="left" if col in ("file", "defines", "kernel") else "right")
    problems, logs = [], []
    for src in sources:
        try:
            variants = declared_defines(src)
        except FileNotFoundError as e:
            raise GDecodeError(str(e)) from None
        for defines in variants:
            _add_rows(table, Path(src), defines, arch, problems, logs)
    console.print(table)
    for log in logs:
        console.print(log, markup=False, highlight=False, soft_wrap=True)
    if problems:
        raise GDecodeError("; ".join(problems))
