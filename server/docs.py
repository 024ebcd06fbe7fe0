"""/docs without a CDN: Swagger UI 5's JS and CSS come from the `fastapi-offline` package.

FastAPI's default /docs page loads them from jsDelivr, so behind a firewall (or on a laptop
offline) it is blank. The same page, pointed at files this server serves itself. Swagger UI 5
is the first to render OpenAPI 3.1, the version FastAPI writes; the `swagger-ui-bundle`
package this used before carries Swagger UI 4.15, which shows "Unable to render this
definition" for it. `fastapi-offline` ships the assets as package data (MIT, no dependency
beyond FastAPI); only its files are used, not its app factory.
"""

from __future__ import annotations

from importlib import resources

from fastapi import FastAPI
from fastapi.openapi.docs import get_swagger_ui_html
from fastapi.responses import HTMLResponse
from fastapi.staticfiles import StaticFiles

__all__ = ["add_offline_docs", "DOCS_ASSETS", "docs_assets_dir"]

DOCS_ASSETS = "/docs-assets"


def docs_assets_dir() -> str:
    """The folder of Swagger UI's `swagger-ui-bundle.js`, `swagger-ui.css` and `favicon.png`."""
    return str(resources.files("fastapi_offline") / "static")


def add_offline_docs(app: FastAPI, docs_url: str = "/docs") -> None:
    """Serve Swagger UI at `docs_url` from local assets under DOCS_ASSETS. Build the app with docs_url=None."""
    app.mount(DOCS_ASSETS, StaticFiles(directory=docs_assets_dir()), name="docs-assets")
    openapi_url = app.openapi_url or "/openapi.json"

    @app.get(docs_url, include_in_schema=False)
    async def docs() -> HTMLResponse:
        return get_swagger_ui_html(
            openapi_url=openapi_url,
            title=f"{app.title} - docs",
            swagger_js_url=f"{DOCS_ASSETS}/swagger-ui-bundle.js",
            swagger_css_url=f"{DOCS_ASSETS}/swagger-ui.css",
            swagger_favicon_url=f"{DOCS_ASSETS}/favicon.png",
        )
