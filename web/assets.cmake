# SPDX-License-Identifier: Apache-2.0
# The files of the web page, each FILE|URL|CONTENT-TYPE (a text type gets "; charset=utf-8").
# One table: web/CMakeLists.txt depends on these files and embed.cmake turns them into C arrays.
set(TALLY_WEB_ASSETS
    "index.html|/|text/html"
    "app.js|/app.js|text/javascript"
    "style.css|/style.css|text/css"
    "favicon.svg|/favicon.svg|image/svg+xml")
