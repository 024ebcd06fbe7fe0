"""/docs without a CDN: Swagger UI's JS and CSS come from the `swagger-ui-bundle` package.

FastAPI's default /docs page loads them from jsDelivr, so behind a firewall (or on a
laptop offline) it is blank. The same page, pointed at files this server serves itself.
"""

from __future__ import annotations

from fastapi import FastAPI
from fastapi.openapi.docs import get_swagger_ui_html
from fastapi.responses import HTMLResponse
from fastapi.staticfiles import StaticFiles

__all__ = ["add_offline_docs", "DOCS_ASSETS"]

DOCS_ASSETS = "/docs-assets"


def add_offline_docs(app: FastAPI, docs_url: str = "/docs") -> None:
    """Serve Swagger UI at `docs_url` from local assets under DOCS_ASSETS. Build the app with docs_url=None."""
    from swagger_ui_bundle import swagger_ui_path

    app.mount(DOCS_ASSETS, StaticFiles(directory=swagger_ui_path), name="docs-assets")
    openapi_url = app.openapi_url or "/openapi.json"

    @app.get(docs_url, include_in_schema=False)
    async def docs() -> HTMLResponse:
        return get_swagger_ui_html(
            openapi_url=openapi_url,
            title=f"{app.title} - docs",
            swagger_js_url=f"{DOCS_ASSETS}/swagger-ui-bundle.js",
            swagger_css_url=f"{DOCS_ASSETS}/swagger-ui.css",
            swagger_favicon_url=f"{DOCS_ASSETS}/favicon-32x32.png",
        )
