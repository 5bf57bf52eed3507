// The console's session state and its calls to the JSON API. The credential lives in
// sessionStorage only and goes out as a bearer token, never as a cookie.

export const STORE = "worldcup.console.credential";

// {session: {role, tenant_name, scopes, detail} | null}
export const state = { session: null };

export function credential() {
  return sessionStorage.getItem(STORE);
}

export function forget() {
  sessionStorage.removeItem(STORE);
}

function authFetch(method, path, headers, body) {
  return fetch(path, {
    method,
    headers: { Authorization: "Bearer " + credential(), ...headers },
    body,
    credentials: "omit",
    cache: "no-store",
    referrerPolicy: "no-referrer",
  });
}

export async function api(method, path, payload) {
  const headers = {};
  if (payload !== undefined) headers["Content-Type"] = "application/json";
  let response;
  try {
    response = await authFetch(method, path, headers, payload === undefined ? undefined : JSON.stringify(payload));
  } catch (err) {
    throw new Error("The service could not be reached (" + err.message + ").");
  }
  let data = null;
  try {
    data = await response.json();
  } catch (err) {
    data = null;
  }
  if (!response.ok) {
    const detail = data && data.error ? data.error.message : response.statusText;
    const error = new Error(`Refused (HTTP ${response.status}): ${detail}`);
    error.status = response.status;
    throw error;
  }
  return data;
}

export async function download(path, name) {
  const response = await authFetch("GET", path, {}, undefined);
  if (!response.ok) throw new Error(`Refused (HTTP ${response.status})`);
  const blob = await response.blob();
  const a = document.createElement("a");
  a.href = URL.createObjectURL(blob);
  a.download = name;
  document.body.appendChild(a);
  a.click();
  a.remove();
  setTimeout(() => URL.revokeObjectURL(a.href), 10000);
}
