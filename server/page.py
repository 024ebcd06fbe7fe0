"""The search page at `/`: plain HTML, CSS and JavaScript shipped in this package.

The page calls the public API (`POST /v1/search` with `explain: true`) from the browser,
so it shows nothing the API does not; no CDN, no build step. The page itself is open:
the API calls it makes carry the key the user types once (kept for the browser session).
"""

from __future__ import annotations

from pathlib import Path

from fastapi import FastAPI
from fastapi.responses import FileResponse
from fastapi.staticfiles import StaticFiles

__all__ = ["add_search_page", "PAGE_DIR", "PAGE_ASSETS"]

PAGE_DIR = Path(__file__).resolve().parent / "page"
PAGE_ASSETS = "/page-assets"


def add_search_page(app: FastAPI, url: str = "/") -> None:
    """Serve the search page at `url` and its assets under PAGE_ASSETS."""
    app.mount(PAGE_ASSETS, StaticFiles(directory=PAGE_DIR), name="page-assets")

    @app.get(url, include_in_schema=False)
    async def search_page() -> FileResponse:
        return FileResponse(PAGE_DIR / "index.html", media_type="text/html")
