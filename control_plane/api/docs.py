"""The interactive API documentation at `/docs`: Swagger UI from the files of the
`swagger-ui-bundle-v2` distribution (pinned in the locks), served by the control plane itself.

Nothing is loaded from another origin, so the page works on an offline install, and no script
is inline: the page, its OAuth2 redirect page and their files carry a Content-Security-Policy
that allows scripts, styles and requests from this origin only.
"""

from __future__ import annotations

from importlib import import_module
from pathlib import Path

from fastapi import APIRouter, Response
from fastapi.responses import FileResponse, HTMLResponse

from control_plane.api.routing import LaneRoute
from control_plane.errors import NotFound

#: Swagger UI's distribution files (`swagger-ui-dist`), as the package ships them.
SWAGGER_UI = Path(str(import_module("swagger_ui_bundle").swagger_ui_path))
#: The script that starts Swagger UI on the page.
INIT_SCRIPT = Path(__file__).with_name("docs.js")
#: The only files of the distribution served, by their name under /docs/assets/.
ASSETS = {
    "swagger-ui-bundle.js": "text/javascript",
    "swagger-ui.css": "text/css",
    "oauth2-redirect.js": "text/javascript",
    "favicon-32x32.png": "image/png",
    "favicon-16x16.png": "image/png",
}
SECURITY_HEADERS = {
    # Swagger UI sets styles through the DOM (allowed) and draws icons from data: URLs.
    "Content-Security-Policy": (
        "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
        "font-src 'self'; connect-src 'self'; base-uri 'none'; frame-ancestors 'none'; "
        "form-action 'none'"
    ),
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
}
_PAGE = """<!doctype html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>ModelForge control plane — API</title>
<link rel="stylesheet" href="/docs/assets/swagger-ui.css">
<link rel="icon" type="image/png" href="/docs/assets/favicon-32x32.png">
</head>
<body>
<div id="swagger-ui"></div>
<script src="/docs/assets/swagger-ui-bundle.js"></script>
<script src="/docs/init.js"></script>
</body>
</html>
"""
_REDIRECT_PAGE = """<!doctype html>
<html lang="en">
<head><meta charset="utf-8"><title>Swagger UI: OAuth2 redirect</title></head>
<body><script src="/docs/assets/oauth2-redirect.js"></script></body>
</html>
"""

router = APIRouter(include_in_schema=False, route_class=LaneRoute)


@router.get("/docs")
async def docs_page() -> Response:
    return HTMLResponse(_PAGE, headers={**SECURITY_HEADERS, "Cache-Control": "no-cache"})


@router.get("/docs/oauth2-redirect")
async def oauth2_redirect_page() -> Response:
    return HTMLResponse(_REDIRECT_PAGE, headers={**SECURITY_HEADERS, "Cache-Control": "no-cache"})


@router.get("/docs/init.js")
async def init_script() -> Response:
    return FileResponse(
        INIT_SCRIPT,
        media_type="text/javascript",
        headers={**SECURITY_HEADERS, "Cache-Control": "no-cache"},
    )


@router.get("/docs/assets/{name}")
async def asset(name: str) -> Response:
    media_type = ASSETS.get(name)
    if media_type is None:
        raise NotFound(
            "No such file of the API documentation.",
            "Open /docs; it loads the files it needs.",
            code="NOT_FOUND",
        )
    return FileResponse(
        SWAGGER_UI / name,
        media_type=media_type,
        headers={**SECURITY_HEADERS, "Cache-Control": "no-cache"},
    )
