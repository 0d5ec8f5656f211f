"""The web dashboard (`tether dashboard`, docs/dashboard.md).

dashboard.py  the server: routes, replies, security headers, the action log
api.py        the read endpoints (GET, no side effects)
actions.py    the actions (POST with the token): cancel, retry, pause, resume
auth.py       the token: where it comes from, how a request proves it
jsonout.py    how values become JSON, and the error every endpoint can answer with
static/       the page's CSS and JavaScript modules (dashboard.html loads them)
"""
