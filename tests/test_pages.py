"""Page corpora (espn.pages.corpus): folders, PDFs and JSONL manifests made here with Pillow, and every bad page
as one line or a skip, the way espn.corpus treats text lines."""

from __future__ import annotations

import hashlib
import io
import json
import logging
import os
import re
import struct
import subprocess
import sys
import time
import zlib
from collections.abc import Generator
from pathlib import Path

import numpy as np
import pypdfium2 as pdfium
import pytest
from PIL import Image

from espn.pages import corpus as pages
from espn.pages import pdf as pdf_module
from espn.corpus import iter_corpus
from espn.errors import CorpusError, InvalidParameterError
from espn.live.encoding import decode_page_bytes
from espn.pages.corpus import Page, count_pages, is_page_corpus, iter_pages, no_pages_error


def save_pdf(path: Path, sizes: list[tuple[int, int]], resolution: float = 72.0) -> Path:
    """A PDF of one page per size (pixels at `resolution` dpi, so points at 72), each a different colour."""
    images = [Image.new("RGB", size, (40 * i % 256, 90, 200)) for i, size in enumerate(sizes)]
    images[0].save(path, save_all=True, append_images=images[1:], resolution=resolution)
    return path


def write_pdf(path: Path, objects: list[bytes], trailer: bytes) -> Path:
    """A PDF written by hand: `objects` numbered from 1, a correct xref table, then `trailer`'s entries."""
    out = bytearray(b"%PDF-1.4\n")
    offsets = []
    for number, body in enumerate(objects, start=1):
        offsets.append(len(out))
        out += b"%d 0 obj\n%s\nendobj\n" % (number, body)
    xref = len(out)
    out += b"xref\n0 %d\n0000000000 65535 f \n" % (len(objects) + 1)
    out += b"".join(b"%010d 00000 n \n" % offset for offset in offsets)
    out += b"trailer\n<< /Size %d %s >>\nstartxref\n%d\n%%%%EOF\n" % (len(objects) + 1, trailer, xref)
    path.write_bytes(bytes(out))
    return path


def rc4(key: bytes, data: bytes) -> bytes:
    state, j = list(range(256)), 0
    for i in range(256):
        j = (j + state[i] + key[i % len(key)]) % 256
        state[i], state[j] = state[j], state[i]
    out, i, j = bytearray(), 0, 0
    for byte in data:
        i = (i + 1) % 256
        j = (j + state[i]) % 256
        state[i], state[j] = state[j], state[i]
        out.append(byte ^ state[(state[i] + state[j]) % 256])
    return bytes(out)


def write_encrypted_pdf(path: Path, user_password: bytes) -> Path:
    """A one-page PDF under the PDF standard security handler, revision 2 (40-bit RC4; PDF 1.7
    section 7.6.3, algorithms 2-4), that opens only with `user_password`. Its page has no strings
    or streams, so nothing else needs encrypting."""
    pad = bytes.fromhex("28BF4E5E4E758A4164004E56FFFA01082E2E00B6D0683E802F0CA9FE6453697A")
    padded = (user_password + pad)[:32]
    owner = rc4(hashlib.md5((b"owner" + pad)[:32]).digest()[:5], padded)
    permissions, file_id = -4, b"0123456789abcdef"
    key = hashlib.md5(padded + owner + struct.pack("<i", permissions) + file_id).digest()[:5]
    user = rc4(key, pad)
    return write_pdf(path, [
        b"<< /Type /Catalog /Pages 2 0 R >>",
        b"<< /Type /Pages /Kids [3 0 R] /Count 1 >>",
        b"<< /Type /Page /Parent 2 0 R /MediaBox [0 0 200 100] >>",
        b"<< /Filter /Standard /V 1 /R 2 /O <%s> /U <%s> /P %d >>" % (owner.hex().encode(), user.hex().encode(),
                                                                       permissions),
    ], b"/Root 1 0 R /Encrypt 4 0 R /ID [<%s> <%s>]" % (file_id.hex().encode(), file_id.hex().encode()))


def png_bomb(path: Path, width: int, height: int) -> Path:
    """A valid 1-bit PNG of zeros: a few KB on disk, width*height pixels decoded."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))
    rows = zlib.compress(b"\0" * ((width + 7) // 8 + 1) * height, 9)
    path.write_bytes(b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 1, 0, 0, 0, 0))
                     + chunk(b"IDAT", rows) + chunk(b"IEND", b""))
    return path


@pytest.fixture()
def folder(tmp_path: Path) -> Path:
    root = tmp_path / "corpus"
    (root / "sub" / "deeper").mkdir(parents=True)
    Image.new("RGBA", (50, 40), (255, 0, 0, 0)).save(root / "b.png")  # fully transparent: white
    Image.new("RGB", (30, 20), (0, 128, 0)).save(root / "A.JPG")
    Image.new("RGB", (16, 16), (0, 0, 255)).save(root / "sub" / "c.webp")
    save_pdf(root / "sub" / "report.pdf", [(144, 72), (72, 144), (100, 100)])
    Image.new("L", (8, 8), 7).save(root / "sub" / "deeper" / "d.jpeg")
    (root / "notes.txt").write_text("not a page")
    (root / ".hidden.png").write_bytes(b"not even an image")  # hidden: passed over, as macOS's ._x.png
    return root


EXPECTED_IDS = ["A.JPG", "b.png", "sub/c.webp", "sub/deeper/d.jpeg", "sub/report.pdf#1", "sub/report.pdf#2",
                "sub/report.pdf#3"]


def test_a_folder_gives_every_image_and_pdf_page_in_sorted_order_as_rgb(folder: Path) -> None:
    found = list(iter_pages(folder))
    assert [p.id for p in found] == EXPECTED_IDS
    assert [p.id for p in iter_pages(folder)] == EXPECTED_IDS  # stable
    assert [(p.source, p.page_number) for p in found[-3:]] == [("sub/report.pdf", n) for n in (1, 2, 3)]
    assert all(p.image.mode == "RGB" and p.metadata == {} and p.page_number >= 1 for p in found)
    by_id = {p.id: p for p in found}
    assert by_id["b.png"].image.getpixel((0, 0)) == (255, 255, 255)  # alpha flattened on white
    assert by_id["sub/report.pdf#1"].image.size == (288, 144)  # 144x72 pt at the default 144 dpi
    assert by_id["sub/report.pdf#2"].image.size == (144, 288)
    assert count_pages(folder) == len(found) == 7
    assert is_page_corpus(folder)


def test_dpi_sets_the_rendered_size_and_is_bounded(tmp_path: Path) -> None:
    pdf = save_pdf(tmp_path / "doc.pdf", [(144, 72), (72, 72)])
    assert is_page_corpus(pdf) and count_pages(pdf) == 2
    assert [(p.id, p.source, p.image.size) for p in iter_pages(pdf, dpi=72)] == [
        ("doc.pdf#1", "doc.pdf", (144, 72)), ("doc.pdf#2", "doc.pdf", (72, 72))]
    assert [p.image.size for p in iter_pages(pdf, dpi=300)] == [(600, 300), (300, 300)]
    for dpi in (35, 601, 144.0, True):
        with pytest.raises(InvalidParameterError, match="dpi"):
            iter_pages(pdf, dpi=dpi)  # type: ignore[arg-type]  # refused at the call, not the first page


def test_a_jsonl_names_images_and_pdf_pages_with_ids_and_metadata(tmp_path: Path) -> None:
    Image.new("RGB", (10, 10), "red").save(tmp_path / "scan#1.png")  # a "#" in an image's name is its name
    (tmp_path / "docs").mkdir()
    save_pdf(tmp_path / "docs" / "two.pdf", [(72, 72), (144, 72)])
    save_pdf(tmp_path / "one.pdf", [(36, 36)])
    records = [{"_id": "p-1", "image": "scan#1.png", "metadata": {"lang": "en"}},
               {"_id": 7, "image": "docs/two.pdf#2"}, {"_id": "p-3", "image": "docs/two.pdf#1"},
               {"_id": "p-4", "image": "one.pdf"}]
    manifest = tmp_path / "pages.jsonl"
    manifest.write_text("\n".join(json.dumps(r) for r in records) + "\n\n")
    assert is_page_corpus(manifest) and count_pages(manifest) == 4
    found = list(iter_pages(manifest, dpi=72))
    assert [(p.id, p.source, p.page_number, p.metadata) for p in found] == [
        ("p-1", "scan#1.png", 1, {"lang": "en"}), ("7", "docs/two.pdf", 2, {}), ("p-3", "docs/two.pdf", 1, {}),
        ("p-4", "one.pdf", 1, {})]
    assert found[1].image.size == (144, 72) and found[0].image.getpixel((0, 0)) == (255, 0, 0)


def test_what_is_and_is_not_a_page_corpus(tmp_path: Path, folder: Path) -> None:
    text = tmp_path / "corpus.jsonl"
    text.write_text('{"_id": "d1", "text": "hello"}\n')
    (tmp_path / "empty").mkdir()
    assert not is_page_corpus(text) and not is_page_corpus(tmp_path / "empty")
    assert not is_page_corpus(tmp_path / "missing") and not is_page_corpus(folder / "notes.txt")
    assert count_pages(text) is None
    with pytest.raises(CorpusError, match="not a page corpus"):
        iter_pages(text)
    with pytest.raises(CorpusError, match="no such file"):
        iter_pages(tmp_path / "missing")


def test_modes_are_converted_to_rgb_with_exif_orientation(tmp_path: Path) -> None:
    Image.fromarray(np.array([[65535, 32896]], dtype=np.uint16)).save(tmp_path / "grey16.png")  # I;16
    Image.new("CMYK", (4, 4), (0, 255, 255, 0)).save(tmp_path / "cmyk.jpg")
    palette = Image.new("P", (4, 4), 1)
    palette.putpalette([0, 0, 0, 10, 20, 30] + [0] * 762)
    palette.save(tmp_path / "palette.png", transparency=1)
    Image.new("LA", (4, 4), (0, 0)).save(tmp_path / "la.png")
    exif = Image.Exif()
    exif[0x0112] = 6  # rotate 90 degrees clockwise to display
    Image.new("RGB", (40, 20), "white").save(tmp_path / "rotated.jpg", exif=exif)
    by_id = {p.id: p.image for p in iter_pages(tmp_path)}
    assert {image.mode for image in by_id.values()} == {"RGB"}
    assert by_id["grey16.png"].getpixel((0, 0)) == (255, 255, 255)
    assert by_id["grey16.png"].getpixel((1, 0)) == (128, 128, 128)  # scaled, not clipped to 255
    red, green, blue = np.asarray(by_id["cmyk.jpg"])[1, 1].tolist()
    assert red > 200 and green < 60 and blue < 60
    assert by_id["palette.png"].getpixel((0, 0)) == (255, 255, 255)
    assert by_id["la.png"].getpixel((0, 0)) == (255, 255, 255)
    assert by_id["rotated.jpg"].size == (20, 40)


def bad_corpus(root: Path) -> dict[str, str]:
    """A folder with one good image and one of each bad page: name -> what its one-line error says."""
    root.mkdir()
    Image.new("RGB", (8, 8)).save(root / "good.png")
    noise = Image.fromarray(np.random.default_rng(0).integers(0, 255, (64, 64, 3), dtype=np.uint8))
    noise.save(root / "truncated.png")
    (root / "truncated.png").write_bytes((root / "truncated.png").read_bytes()[:2000])
    noise.save(root / "truncated.jpg", quality=95)
    (root / "truncated.jpg").write_bytes((root / "truncated.jpg").read_bytes()[:1500])
    noise.save(root / "jpeg-named.png", format="JPEG")
    (root / "png-named.pdf").write_bytes((root / "good.png").read_bytes())
    (root / "broken.pdf").write_bytes(b"%PDF-1.4\n1 0 obj << /Type /Catalog >>\n%%EOF\n")
    write_encrypted_pdf(root / "encrypted.pdf", b"secret")
    Image.new("1", (20_000, 8)).save(root / "tall-scan.png")
    png_bomb(root / "bomb.png", 9_000, 9_000)  # 81 MP: ours refuses it, under Pillow's own limit
    png_bomb(root / "huge-bomb.png", 100_000, 2_000)  # 200 MP: Pillow's own check refuses it first
    save_pdf(root / "poster.pdf", [(300, 10)], resolution=1)  # 300 x 10 inches: 43,200 px wide at 144 dpi
    return {"truncated.png": "unreadable PNG image", "truncated.jpg": "unreadable JPEG image",
            "jpeg-named.png": "not a PNG image", "png-named.pdf": "not a readable PDF",
            "broken.pdf": "not a readable PDF", "encrypted.pdf": "encrypted",
            "tall-scan.png": "refused, 20000x8 px", "bomb.png": "refused, 9000x9000 px",
            "huge-bomb.png": "refused, ", "poster.pdf#1": "refused, 43200x1440 px .* at 144 dpi"}


def test_every_bad_page_is_one_line_naming_the_file(tmp_path: Path) -> None:
    expected = bad_corpus(tmp_path / "bad")
    for name, message in expected.items():
        single = tmp_path / "one" / name.split("#")[0]
        single.parent.mkdir(exist_ok=True)
        os.replace(tmp_path / "bad" / name.split("#")[0], single)
        started = time.perf_counter()
        with pytest.raises(CorpusError) as raised:
            list(iter_pages(single))
        assert time.perf_counter() - started < 2, name  # headers only: no bomb is decoded
        text = str(raised.value)
        assert "\n" not in text and str(single.parent / name) in text, text
        assert re.search(message, text), (name, text)
        os.replace(single, tmp_path / "bad" / name.split("#")[0])
    # the encrypted PDF is a real one: its password opens it
    with pdfium.PdfDocument(tmp_path / "bad" / "encrypted.pdf", password="secret") as document:
        assert len(document) == 1


def test_skip_bad_skips_each_bad_page_with_a_warning_and_a_count(tmp_path: Path,
                                                                 caplog: pytest.LogCaptureFixture) -> None:
    expected = bad_corpus(tmp_path / "bad")
    save_pdf(tmp_path / "bad" / "wide.pdf", [(72, 72), (300, 10), (72, 36)], resolution=72)
    with caplog.at_level(logging.WARNING, logger="espn.pages.corpus"):
        found = list(iter_pages(tmp_path / "bad", dpi=600, skip_bad=True))
    # wide.pdf's 300-pt page is 2500 px wide at 600 dpi (fits); the poster's 300 inches do not
    assert [p.id for p in found] == ["good.png", "wide.pdf#1", "wide.pdf#2", "wide.pdf#3"]
    skipped = [r.getMessage() for r in caplog.records if r.getMessage().startswith("skipped ")]
    assert len(skipped) == len(expected)
    assert caplog.records[-1].getMessage() == f"{tmp_path / 'bad'}: skipped {len(expected)} bad page(s) or file(s)"


def test_a_bad_page_inside_a_good_pdf_is_skipped_alone(tmp_path: Path) -> None:
    pdf = save_pdf(tmp_path / "mixed.pdf", [(10, 10), (300, 10), (10, 5)], resolution=1)  # inches
    with pytest.raises(CorpusError, match=r"mixed\.pdf#2: refused, .* at 144 dpi"):
        list(iter_pages(pdf))
    # page 1 is 10 in = 1,440 px a side at 144 dpi (fits), page 2 is 43,200 px wide
    assert [p.id for p in iter_pages(pdf, skip_bad=True)] == ["mixed.pdf#1", "mixed.pdf#3"]


def test_links_are_followed_only_inside_the_root(tmp_path: Path) -> None:
    root, outside = tmp_path / "root", tmp_path / "outside"
    root.mkdir()
    outside.mkdir()
    Image.new("RGB", (4, 4)).save(root / "a.png")
    Image.new("RGB", (4, 4)).save(outside / "secret.png")
    (root / "alias.png").symlink_to(root / "a.png")
    (root / "escape.png").symlink_to(outside / "secret.png")
    (root / "folder-link").symlink_to(outside, target_is_directory=True)  # a link to a folder is not walked
    with pytest.raises(CorpusError, match=r"escape\.png.*outside"):
        list(iter_pages(root))
    assert [p.id for p in iter_pages(root, skip_bad=True)] == ["a.png", "alias.png"]
    assert count_pages(root) == 2


def test_a_jsonl_path_never_leaves_its_folder(tmp_path: Path) -> None:
    root = tmp_path / "root"
    root.mkdir()
    Image.new("RGB", (4, 4)).save(tmp_path / "secret.png")
    Image.new("RGB", (4, 4)).save(root / "ok.png")
    (root / "link.png").symlink_to(tmp_path / "secret.png")
    for image in ("../secret.png", str(tmp_path / "secret.png"), "link.png"):
        manifest = root / "pages.jsonl"
        manifest.write_text(json.dumps({"_id": "x", "image": image}) + "\n")
        with pytest.raises(CorpusError, match="refused") as raised:
            list(iter_pages(manifest))
        assert str(raised.value).startswith(f"{manifest}:1: ") and "\n" not in str(raised.value)


def test_bad_jsonl_records_are_one_line_each_and_duplicates_always_fail(tmp_path: Path) -> None:
    Image.new("RGB", (4, 4)).save(tmp_path / "ok.png")
    save_pdf(tmp_path / "two.pdf", [(72, 72), (72, 72)])
    lines = ['{"_id": "a", "image": "ok.png"}', "{not json", '["a list"]', '{"_id": "b"}',
             '{"_id": "c", "image": "notes.txt"}', '{"_id": "d", "image": "two.pdf#3"}',
             '{"_id": "e", "image": "two.pdf"}',
             '{"_id": " f", "image": "ok.png"}', '{"_id": "g", "image": "missing.png"}',
             '{"_id": "h", "image": "ok.png", "metadata": {"bad name!": 1}}', '{"_id": "i", "image": "two.pdf#2"}']
    manifest = tmp_path / "pages.jsonl"
    manifest.write_text("\n".join(lines) + "\n")
    messages = ["malformed JSON", "expected a JSON object", "'image' must be", "not a PNG, JPEG, WebP or PDF",
                "no page 3", "a PDF of 2 pages", "starts or ends with whitespace", "does not exist",
                "metadata field name"]
    for number, message in enumerate(messages, start=2):
        manifest.write_text("\n".join([lines[0], lines[number - 1]]) + "\n")
        with pytest.raises(CorpusError, match=message) as raised:
            list(iter_pages(manifest))
        assert str(raised.value).startswith(f"{manifest}:2: ") and "\n" not in str(raised.value)
    manifest.write_text("\n".join(lines) + "\n")
    assert [p.id for p in iter_pages(manifest, skip_bad=True)] == ["a", "i"]
    manifest.write_text("\n".join(lines + ['{"_id": "a", "image": "two.pdf#1"}']) + "\n")
    with pytest.raises(CorpusError, match=rf"{manifest.name}:12: duplicate page id 'a'"):
        list(iter_pages(manifest, skip_bad=True))


def test_a_deeply_nested_jsonl_line_is_refused_in_one_line_before_the_parser(tmp_path: Path) -> None:
    """Python's json recurses: a line of 100,000 brackets would be a RecursionError (a traceback)."""
    Image.new("RGB", (4, 4)).save(tmp_path / "ok.png")
    manifest = tmp_path / "pages.jsonl"
    deep = '{"_id": "b", "image": "ok.png", "metadata": ' + "[" * 100_000 + "]" * 100_000 + "}"
    manifest.write_text('{"_id": "a", "image": "ok.png"}\n' + deep + "\n")
    with pytest.raises(CorpusError) as raised:
        list(iter_pages(manifest))
    assert str(raised.value) == f"{manifest}:2: refused, JSON nested 100001 levels deep (at most 64)"
    manifest.write_text(deep + "\n")  # as the first line: not taken for a page corpus; the text reader refuses it
    assert not is_page_corpus(manifest)
    with pytest.raises(CorpusError) as raised:
        list(iter_corpus(manifest))
    assert str(raised.value) == f"{manifest}:1: refused, JSON nested 100001 levels deep (at most 64)"


def test_bounds_on_file_size_and_pdf_pages(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    Image.new("RGB", (64, 64)).save(tmp_path / "a.png")
    save_pdf(tmp_path / "b.pdf", [(72, 72)] * 3)
    monkeypatch.setattr(pages, "MAX_IMAGE_BYTES", 10)
    monkeypatch.setattr(pdf_module, "MAX_PDF_PAGES", 2)
    with pytest.raises(CorpusError, match=r"a\.png: refused, \d+ bytes \(at most 10 for an image\)"):
        list(iter_pages(tmp_path))
    with pytest.raises(CorpusError, match=r"b\.pdf: refused, 3 pages \(at most 2 a PDF\)"):
        list(iter_pages(tmp_path / "b.pdf"))
    monkeypatch.setattr(pdf_module, "MAX_PDF_BYTES", 10)
    with pytest.raises(CorpusError, match=r"b\.pdf: refused, \d+ bytes \(at most 10 for a PDF\)"):
        list(iter_pages(tmp_path / "b.pdf"))


def test_a_fifo_named_like_an_image_is_refused_without_hanging(tmp_path: Path) -> None:
    Image.new("RGB", (4, 4)).save(tmp_path / "a.png")
    os.mkfifo(tmp_path / "pipe.png")
    with pytest.raises(CorpusError, match=r"pipe\.png.*FIFO"):
        list(iter_pages(tmp_path))
    assert [p.id for p in iter_pages(tmp_path, skip_bad=True)] == ["a.png"]


def open_descriptors() -> int:
    return len(os.listdir("/proc/self/fd"))


def test_documents_are_closed_when_done_and_when_abandoned(folder: Path, tmp_path: Path) -> None:
    before = open_descriptors()
    list(iter_pages(folder))
    assert open_descriptors() == before
    walk = iter_pages(folder)
    assert isinstance(walk, Generator)  # closing it closes what it holds open
    first = [next(walk) for _ in range(5)]  # inside report.pdf
    assert first[-1].id == "sub/report.pdf#1" and open_descriptors() == before + 1
    walk.close()
    assert open_descriptors() == before
    manifest = tmp_path / "pages.jsonl"
    manifest.write_text('{"_id": "a", "image": "sub/report.pdf#2"}\n{"_id": "b", "image": "sub/report.pdf#1"}\n'
                        '{"_id": "a", "image": "b.png"}\n')
    (tmp_path / "sub").symlink_to(folder / "sub")  # resolves inside tmp_path, the manifest's folder
    with pytest.raises(CorpusError, match="duplicate"):  # raised with report.pdf open
        list(iter_pages(manifest))
    assert open_descriptors() == before
    assert isinstance(first[0], Page)


def test_make_synthetic_page_mode_writes_pages_of_fixed_patch_counts(tmp_path: Path) -> None:
    """`benchmarks.make_synthetic --pages`: every record holds exactly --patches 128-d vectors (multi-block
    records), from a source index narrower than that (its vectors widened by an isometry)."""
    from benchmarks.make_synthetic import generate

    rng = np.random.default_rng(0)
    source = tmp_path / "src"
    (source / "CLS").mkdir(parents=True)
    (source / "BOW").mkdir()
    counts = rng.integers(3, 9, 40)
    np.save(source / "CLS" / "0.npy", rng.normal(size=(40, 16)).astype(np.float16))
    np.save(source / "BOW" / "0.npy", rng.normal(size=(int(counts.sum()), 8)).astype(np.float16))
    (source / "BOW" / "0.json").write_text(json.dumps(counts.tolist()))
    built = subprocess.run([str(Path(sys.executable).with_name("espn")), "index", "--embeddings", str(source), "--out",
                            str(tmp_path / "source-index"), "--nlist", "1", "--no-progress"],
                           capture_output=True, text=True, timeout=300)
    assert built.returncode == 0, built.stderr
    info = generate(tmp_path / "pages", 24, tmp_path / "source-index", d_cls=32, d_bow=128, queries=4, chunk_size=10,
                    nlist=1, ann="flat", patches=1030)
    manifest = json.loads((tmp_path / "pages" / "manifest.json").read_text())
    assert manifest["counts"]["documents"] == 24 and manifest["counts"]["bow_vectors"] == 24 * 1030
    assert manifest["store"]["d_bow"] == 128 and info["params"]["patches"] == 1030
    records = np.load(tmp_path / "pages" / "records.npy")
    # int8 records by default, as `espn index` writes a page model's: one byte a value, still many blocks
    assert manifest["store"]["dtype"] == "int8" and manifest["first_stage"]["kind"] == "centroids"
    assert set(records["n_bow"].tolist()) == {1030} and records["length"].min() >= 1030 * 128


def test_a_file_given_alone_is_read_by_its_name_or_first_bytes_and_other_image_types_are_refused_by_name(
        tmp_path: Path) -> None:
    Image.new("RGB", (8, 6), (200, 0, 0)).save(tmp_path / "scan", format="PNG")  # a scan saved without a suffix
    os.replace(save_pdf(tmp_path / "report.pdf", [(72, 72)] * 2), tmp_path / "report")
    Image.new("RGB", (8, 6)).save(tmp_path / "fax.tiff")
    Image.new("RGB", (8, 6)).save(tmp_path / "fax", format="TIFF")
    Image.new("RGB", (8, 6)).save(tmp_path / "anim.gif")
    (tmp_path / "notes.tsv").write_bytes(b"%PDF-1 is a document id\ttext\n")  # named as text: read as text
    assert [(p.id, p.image.size) for p in iter_pages(tmp_path / "scan")] == [("scan", (8, 6))]
    assert [p.id for p in iter_pages(tmp_path / "report")] == ["report#1", "report#2"]
    assert count_pages(tmp_path / "scan") == 1 and count_pages(tmp_path / "report") == 2
    assert not is_page_corpus(tmp_path / "notes.tsv")
    for name, kind in (("fax.tiff", "TIFF"), ("fax", "TIFF"), ("anim.gif", "GIF")):
        assert is_page_corpus(tmp_path / name) and count_pages(tmp_path / name) == 0
        message = f"{tmp_path / name}: refused, a {kind} image; pages are read from PNG, JPEG, WebP and PDF files"
        with pytest.raises(CorpusError, match=re.escape(message)):
            list(iter_pages(tmp_path / name))
        assert str(no_pages_error(tmp_path / name)).startswith(message)
    # in a folder: refused by name (skipped with skip_bad), never passed over as if it were no image
    folder = tmp_path / "folder"
    folder.mkdir()
    os.replace(tmp_path / "fax.tiff", folder / "fax.tiff")
    os.replace(tmp_path / "scan", folder / "scan.png")
    with pytest.raises(CorpusError, match=re.escape(f"{folder / 'fax.tiff'}: refused, a TIFF image")):
        list(iter_pages(folder))
    assert [p.id for p in iter_pages(folder, skip_bad=True)] == ["scan.png"]


def test_why_a_corpus_has_no_pages_is_the_refusal_of_its_first_file(tmp_path: Path) -> None:
    write_encrypted_pdf(tmp_path / "locked.pdf", b"secret")
    (tmp_path / "notes.pdf").write_text("meeting notes, not a PDF\n")
    write_pdf(tmp_path / "million.pdf", [b"<< /Type /Catalog /Pages 2 0 R >>",
                                         b"<< /Type /Pages /Kids [3 0 R] /Count 1000000 >>",
                                         b"<< /Type /Page /Parent 2 0 R /MediaBox [0 0 200 100] >>"], b"/Root 1 0 R")
    for name, reason in (("locked.pdf", "refused, the PDF is encrypted"), ("notes.pdf", "not a readable PDF"),
                         ("million.pdf", "refused, 1000000 pages (at most 10000 a PDF)")):
        assert count_pages(tmp_path / name) == 0
        assert str(no_pages_error(tmp_path / name)).startswith(f"{tmp_path / name}: {reason}")
    folder = tmp_path / "folder"
    folder.mkdir()
    os.replace(tmp_path / "locked.pdf", folder / "a.pdf")
    os.replace(tmp_path / "notes.pdf", folder / "b.pdf")
    assert count_pages(folder) == 0
    assert str(no_pages_error(folder)) == (f"{folder / 'a.pdf'}: refused, the PDF is encrypted (it needs a password); "
                                           "the corpus has no readable pages")


def test_an_uploaded_page_of_another_image_type_is_named(tmp_path: Path) -> None:
    out = io.BytesIO()
    Image.new("RGB", (8, 6)).save(out, format="TIFF")
    with pytest.raises(CorpusError, match=re.escape("upload: not a PNG, JPEG or WebP image (by its first bytes) "
                                                    "(a TIFF file)")):
        decode_page_bytes(out.getvalue(), "upload")
