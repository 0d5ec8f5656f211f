// Talking to the server: reads (GET, no token) and actions (POST with the token in a header).
// The token is kept in sessionStorage for this tab only, never in a URL.

const TOKEN_KEY = "tether-dashboard-token";

export class HttpError extends Error {
  constructor(status, message) {
    super(message);
    this.status = status;
  }
}

async function answer(response) {
  let body = null;
  try { body = await response.json(); } catch (err) { body = null; }
  if (!response.ok) {
    throw new HttpError(response.status, (body && body.error) || response.statusText || String(response.status));
  }
  return body;
}

// A read. The token goes along when there is one: a dashboard that listens beyond
// loopback needs it for reads too.
export async function getJSON(path) {
  const secret = token();
  const headers = secret ? { "Authorization": "Bearer " + secret } : {};
  try {
    return await answer(await fetch(path, { cache: "no-store", headers }));
  } catch (err) {
    if (secret && err instanceof HttpError && (err.status === 401 || err.status === 403)) forget();
    throw err;
  }
}

function forget() {
  setToken(null); // the server's token changed: ask again
  window.dispatchEvent(new Event("tether-token"));
}

export function token() {
  try { return sessionStorage.getItem(TOKEN_KEY); } catch (err) { return null; }
}

export function setToken(value) {
  if (value) sessionStorage.setItem(TOKEN_KEY, value);
  else sessionStorage.removeItem(TOKEN_KEY);
}

async function post(path, body, secret) {
  return answer(await fetch(path, {
    method: "POST",
    cache: "no-store",
    headers: { "Content-Type": "application/json", "Authorization": "Bearer " + secret },
    body: JSON.stringify(body || {}),
  }));
}

// Is this token the dashboard's? (A POST that changes nothing.)
export async function checkToken(secret) {
  return post("api/auth/check", {}, secret);
}

export async function act(name, body) {
  const secret = token();
  if (!secret) throw new HttpError(401, "enter the dashboard token first");
  try {
    return await post("api/actions/" + name, body, secret);
  } catch (err) {
    if (err instanceof HttpError && (err.status === 401 || (err.status === 403 && /token/.test(err.message)))) {
      forget();
    }
    throw err;
  }
}
