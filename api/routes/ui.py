"""The dashboard at /ui: plain HTML, CSS and a little JS, served from the package (no build step,
no CDN). The page itself holds no data; it reads the API with the admin key the operator types
(kept in the tab's sessionStorage), or with none when the server runs without keys (loopback)."""
from __future__ import annotations

from importlib import resources

from fastapi import APIRouter, HTTPException, Response
from fastapi.responses import RedirectResponse

router = APIRouter(include_in_schema=False)

ASSETS = {"app.js": "text/javascript; charset=utf-8", "app.css": "text/css; charset=utf-8",
          "index.html": "text/html; charset=utf-8"}
# everything from this origin only; blob: for the audio player (fetched with the key, then played)
HEADERS = {
    "Content-Security-Policy": "default-src 'self'; img-src 'self' data:; media-src 'self' blob:; "
                               "style-src 'self'; script-src 'self'; connect-src 'self'; frame-ancestors 'none'; "
                               "base-uri 'none'; form-action 'none'",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-cache",
}


def asset(name: str) -> bytes:
    return resources.files("omniflow.api").joinpath("ui", name).read_bytes()


@router.get("/ui")
async def index() -> Response:
    return Response(asset("index.html"), media_type=ASSETS["index.html"], headers=HEADERS)


@router.get("/ui/")
async def index_slash() -> RedirectResponse:
    return RedirectResponse("/ui", status_code=308)


@router.get("/ui/{name}")
async def static(name: str) -> Response:
    if name not in ASSETS:
        raise HTTPException(404, f"no such dashboard file {name!r}")
    return Response(asset(name), media_type=ASSETS[name], headers=HEADERS)
