"""Page memory: a server's peak RSS under batches of big page images, a page build's, and one page's steps.

    python -m benchmarks.bench_page_memory                  # as root: each case in a memory cgroup
    python -m benchmarks.bench_page_memory --quick

Three measurements with a tiny seeded ColPali (benchmarks.make_visual_checkpoint, or --model):

- steps: one page of --megapixels MP (a 1-bit PNG, and the same as RGB and RGBA) decoded,
  stored as JPEG and run through the model's processor in a fresh process, the peak RSS of each
  step over what was held before it (the kernel's VmHWM, reset between steps): what
  espn.pages.memory.PAGE_BYTES_PER_PIXEL must cover;
- server: `espn serve` of a 4-page index in a memory cgroup of --server-limit-gib, then one
  `POST /v1/documents/batch` of --batch such pages (a few KB each as PNG) and --puts concurrent
  single-page PUTs; the answers, seconds, and the server's RSS when ready and at its peak;
- build: `espn index` of a --pdf-pages page PDF of text (well under 0.1 MB) at the defaults (144
  dpi, chunks of 1,024, one loader worker) in a cgroup of --build-limit-gib; the peak of the
  process tree's RSS and PSS, sampled every 50 ms, and seconds.

Without cgroups (not root) each case runs without a limit and the script says so. A case
whose process the cgroup killed is reported with `oom_kills`.
"""

from __future__ import annotations

import argparse
import base64
import concurrent.futures
import contextlib
import io
import multiprocessing
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Iterator, Sequence

import psutil
from PIL import Image

from benchmarks.common import (MemoryCgroup, cgroup_unavailable_reason, free_port, http, machine, machine_line,
                               markdown_table, rss_pss, write_results)
from benchmarks.make_visual_checkpoint import write_checkpoint

__all__ = ["text_pdf", "one_bit_png", "main"]

BIN = Path(sys.executable).parent


def text_pdf(path: Path, pages: int) -> Path:
    """A PDF of `pages` A4 pages that share one content stream of two lines of text: a few hundred
    bytes a page, 1191 x 1684 px each at 144 dpi."""
    content = (b"BT /F1 12 Tf 72 770 Td (The quarterly report shows revenue by region.) Tj 0 -16 Td "
               b"(A second line of text.) Tj ET")
    objects = [b"<< /Type /Catalog /Pages 2 0 R >>",
               b"<< /Type /Pages /Kids [%s] /Count %d >>" % (b" ".join(b"%d 0 R" % (5 + i) for i in range(pages)), pages),
               b"<< /Type /Font /Subtype /Type1 /BaseFont /Helvetica >>",
               b"<< /Length %d >>\nstream\n%s\nendstream" % (len(content), content)]
    objects += [b"<< /Type /Page /Parent 2 0 R /MediaBox [0 0 595 842] /Resources << /Font << /F1 3 0 R >> >> "
                b"/Contents 4 0 R >>"] * pages
    out = bytearray(b"%PDF-1.4\n")
    offsets = []
    for number, body in enumerate(objects, start=1):
        offsets.append(len(out))
        out += b"%d 0 obj\n%s\nendobj\n" % (number, body)
    xref = len(out)
    out += b"xref\n0 %d\n0000000000 65535 f \n" % (len(objects) + 1)
    out += b"".join(b"%010d 00000 n \n" % offset for offset in offsets)
    out += b"trailer\n<< /Size %d /Root 1 0 R >>\nstartxref\n%d\n%%%%EOF\n" % (len(objects) + 1, xref)
    path.write_bytes(bytes(out))
    return path


def one_bit_png(size: tuple[int, int], mode: str = "1") -> bytes:
    """A blank page of `size` px as PNG: a few KB in mode "1", 119 MB of RGB once decoded at 39.7 MP."""
    out = io.BytesIO()
    Image.new(mode, size, "white").save(out, format="PNG", optimize=mode == "1")
    return out.getvalue()


def _sides(megapixels: float) -> tuple[int, int]:
    """A 4:3 page of about `megapixels` MP (39.7 is 7300 x 5440 at 4:2.98)."""
    width = int((megapixels * 1e6 * 4 / 3) ** 0.5)
    return width, int(megapixels * 1e6 / width)


@contextlib.contextmanager
def _cgroup(name: str, limit_gib: float, use: bool) -> Iterator[MemoryCgroup | None]:
    group = MemoryCgroup(f"espn_bench_{os.getpid()}_{name}", int(limit_gib * 2**30)) if use else None
    try:
        yield group
    finally:
        if group is not None:
            group.remove()


def _reset_peak() -> int:
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := the RSS now
    return rss_pss()["rss"]


def measure_steps(model: Path, megapixels: float) -> list[dict[str, Any]]:
    """Peak RSS of each step of one page, over what was held before the step, per image mode."""
    from espn.encoders import encoder_from_spec
    from espn.live.encoding import decode_page_bytes
    from espn.pages.images import encode_page_image

    encoder: Any = encoder_from_spec(f"visual:{model}", device="cpu")
    rows = []
    for mode in ("1", "RGB", "RGBA"):
        data = one_bit_png(_sides(megapixels), mode)
        row: dict[str, Any] = {"mode": mode, "png_bytes": len(data), "pixels": _sides(megapixels)[0] * _sides(megapixels)[1]}
        start = _reset_peak()
        image = decode_page_bytes(data, "page")
        row["decode_peak"], row["decoded_held"] = rss_pss()["peak_rss"] - start, rss_pss()["rss"] - start
        before = _reset_peak()
        encode_page_image(image)
        row["jpeg_peak"] = rss_pss()["peak_rss"] - before
        before = _reset_peak()
        features = encoder.preprocess_pages([image])
        row["processor_peak"] = rss_pss()["peak_rss"] - before
        row["page_peak"] = max(row["decode_peak"], row["decoded_held"] + row["jpeg_peak"],
                               row["decoded_held"] + row["processor_peak"])
        row["bytes_per_pixel"] = round(row["page_peak"] / row["pixels"], 2)
        del image, features
        rows.append(row)
    return rows


def measure_steps_apart(model: Path, megapixels: float) -> list[dict[str, Any]]:
    """`measure_steps` in a fresh interpreter: a process that has freed large blocks before (glibc
    then raises its mmap threshold and serves the next ones from memory already resident) shows
    no peak for a step that allocates hundreds of MiB."""
    context = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(1, mp_context=context) as pool:
        return pool.submit(measure_steps, model, megapixels).result()


def _index(model: Path, work: Path) -> Path:
    corpus = work / "small-pages"
    corpus.mkdir()
    for number in range(4):
        Image.new("RGB", (64, 48), (40 * number, 90, 200)).save(corpus / f"p{number}.png")
    out = work / "index"
    subprocess.run([str(BIN / "espn"), "index", str(corpus), "--out", str(out), "--encoder", f"visual:{model}",
                    "--bow-dtype", "float16", "--no-progress", "--device", "cpu"], check=True, capture_output=True)
    return out


def measure_server(model: Path, work: Path, args: argparse.Namespace, cgroups: bool) -> dict[str, Any]:
    index = _index(model, work)
    page = base64.b64encode(one_bit_png(_sides(args.megapixels))).decode()
    port = free_port()
    command = [str(BIN / "espn"), "serve", str(index), "--port", str(port), "--host", "127.0.0.1"]
    row: dict[str, Any] = {"case": f"server: batch of {args.batch} + {args.puts} concurrent PUTs of "
                                   f"{args.megapixels} MP", "limit_gib": args.server_limit_gib if cgroups else None}
    with _cgroup("server", args.server_limit_gib, cgroups) as group, open(work / "server.log", "wb") as log:
        server = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, preexec_fn=group.enter if group else None)
        try:
            _wait_ready(server, f"http://127.0.0.1:{port}")
            row["ready_rss"] = rss_pss(server.pid)["rss"]
            started = time.perf_counter()
            body = {"upsert": [{"id": f"big-{i}", "image": page} for i in range(args.batch)]}
            row["batch_body_bytes"] = sum(len(d["image"]) for d in body["upsert"])
            row["batch_status"] = _status(lambda: http().post(f"http://127.0.0.1:{port}/v1/documents/batch",
                                                              json=body, timeout=3600))
            with concurrent.futures.ThreadPoolExecutor(max(1, args.puts)) as pool:
                row["put_statuses"] = sorted(pool.map(lambda i: _status(lambda: http().put(
                    f"http://127.0.0.1:{port}/v1/documents/put-{i}", json={"image": page}, timeout=3600)),
                    range(args.puts)))
            row["seconds"] = round(time.perf_counter() - started, 1)
            row["peak_rss"] = rss_pss(server.pid).get("peak_rss")
        finally:
            server.terminate()
            row["exit"] = server.wait(60)
            if group is not None:
                row["cgroup_peak"], row["oom_kills"] = group.peak(), group.oom_kills()
    return row


def _status(request: Any) -> int | str:
    try:
        return request().status_code
    except Exception as exc:  # noqa: BLE001 - a server killed mid-request is the finding
        return type(exc).__name__


def _wait_ready(server: subprocess.Popen, base: str, timeout_s: float = 300) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise RuntimeError(f"the server exited with {server.returncode}")
        with contextlib.suppress(Exception):
            if http().get(f"{base}/readyz", timeout=5).status_code == 200:
                return
        time.sleep(0.2)
    raise RuntimeError(f"the server was not ready within {timeout_s:.0f} s")


def measure_build(model: Path, work: Path, args: argparse.Namespace, cgroups: bool) -> dict[str, Any]:
    pdf = text_pdf(work / "report.pdf", args.pdf_pages)
    command = [sys.executable, "-m", "espn.cli", "index", str(pdf), "--out", str(work / "built"), "--encoder",
               f"visual:{model}", "--no-progress", "--device", "cpu"]
    row: dict[str, Any] = {"case": f"build: {args.pdf_pages}-page PDF ({pdf.stat().st_size / 1e6:.2f} MB) at the "
                                   "defaults", "limit_gib": args.build_limit_gib if cgroups else None}
    with _cgroup("build", args.build_limit_gib, cgroups) as group:
        started = time.perf_counter()
        build = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                 preexec_fn=group.enter if group else None)
        row["peak_tree_rss"] = row["peak_tree_pss"] = 0
        while build.poll() is None:
            rss, pss = _tree(build.pid)
            row["peak_tree_rss"], row["peak_tree_pss"] = max(row["peak_tree_rss"], rss), max(row["peak_tree_pss"], pss)
            time.sleep(0.05)
        row["exit"], row["seconds"] = build.returncode, round(time.perf_counter() - started, 1)
        row["error"] = build.stderr.read().decode(errors="replace").strip().splitlines()[-1:] if build.returncode else []
        if group is not None:
            row["cgroup_peak"], row["oom_kills"] = group.peak(), group.oom_kills()
    return row


def _tree(pid: int) -> tuple[int, int]:
    """RSS and PSS of a process and its descendants now (PSS shares what they share)."""
    rss = pss = 0
    with contextlib.suppress(psutil.NoSuchProcess):
        root = psutil.Process(pid)
        for process in [root, *root.children(recursive=True)]:
            numbers = rss_pss(process.pid)
            rss, pss = rss + numbers.get("rss", 0), pss + numbers.get("pss", 0)
    return rss, pss


def _mib(value: Any) -> str:
    return "" if value is None else f"{value / 2**20:,.0f}"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=None, help="a ColPali-class checkpoint (default: a tiny one)")
    parser.add_argument("--megapixels", type=float, default=39.7, help="pixels of each big page, in MP (default 39.7)")
    parser.add_argument("--batch", type=int, default=32, help="big pages in one batch (default 32)")
    parser.add_argument("--puts", type=int, default=8, help="concurrent single-page PUTs after it (default 8)")
    parser.add_argument("--server-limit-gib", type=float, default=6.0, help="the server's cgroup (default 6)")
    parser.add_argument("--pdf-pages", type=int, default=400, help="pages of the PDF built (default 400)")
    parser.add_argument("--build-limit-gib", type=float, default=1.5, help="the build's cgroup (default 1.5)")
    parser.add_argument("--quick", action="store_true", help="small cases: 2 MP pages, 3 + 2 writes, 12 PDF pages")
    parser.add_argument("--name", default="page_memory", help="results name (benchmarks/results/NAME.json)")
    args = parser.parse_args(argv)
    if args.quick:
        args.megapixels, args.batch, args.puts, args.pdf_pages = 2.0, 3, 2, 12
    reason = cgroup_unavailable_reason()
    if reason is not None:
        print(f"no memory cgroups ({reason}): every case runs without a limit", file=sys.stderr)
    info = machine()
    with tempfile.TemporaryDirectory() as scratch:
        work = Path(scratch)
        model = args.model or write_checkpoint(work / "tiny-colpali")
        steps = measure_steps_apart(model, args.megapixels)
        (work / "server").mkdir()
        (work / "build").mkdir()
        cases = [measure_server(model, work / "server", args, reason is None),
                 measure_build(model, work / "build", args, reason is None)]
        shutil.rmtree(work / "server", ignore_errors=True)
    print(f"Measured on {machine_line(info)}.\n")
    print(markdown_table(["mode", "PNG bytes", "decode peak MiB", "decoded MiB", "JPEG peak MiB", "processor peak MiB",
                          "page peak MiB", "bytes/pixel"],
                         [[s["mode"], s["png_bytes"], _mib(s["decode_peak"]), _mib(s["decoded_held"]),
                           _mib(s["jpeg_peak"]), _mib(s["processor_peak"]), _mib(s["page_peak"]), s["bytes_per_pixel"]]
                          for s in steps]))
    print()
    print(markdown_table(["case", "limit GiB", "answers / exit", "seconds", "RSS ready MiB", "peak RSS MiB",
                          "peak tree PSS MiB", "cgroup peak MiB", "OOM kills"],
                         [[c["case"], c["limit_gib"] or "none",
                           f"{c.get('batch_status', '')} {c.get('put_statuses', '')} exit {c['exit']}".strip(),
                           c.get("seconds"), _mib(c.get("ready_rss")), _mib(c.get("peak_rss", c.get("peak_tree_rss"))),
                           _mib(c.get("peak_tree_pss")), _mib(c.get("cgroup_peak")), c.get("oom_kills", "")]
                          for c in cases]))
    write_results(args.name, {"machine": info, "args": {k: str(v) for k, v in vars(args).items()}, "steps": steps,
                              "cases": cases})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
