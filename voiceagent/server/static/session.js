// Signing in: the server's token is traded once for an HttpOnly session cookie (POST
// /api/session), which every later fetch, EventSource and WebSocket carries. The token never goes
// in a URL's path or query (access logs, history); a link may carry it in the fragment
// (#token=...), which browsers never send, and which is removed at once.
"use strict";

async function openSession(token) {
  const res = await fetch("/api/session", {
    method: "POST",
    headers: { "Content-Type": "application/json" },
    body: JSON.stringify({ token }),
  });
  return res.ok;
}

async function sessionFromFragment() {
  const m = location.hash.match(/(?:^#|&)token=([^&]*)/);
  if (!m) return false;
  history.replaceState(null, "", location.pathname + location.search);
  return openSession(decodeURIComponent(m[1]));
}

// A token form inside `box` (replacing what it shows); resolves once a session is open.
function askForToken(box, message) {
  return new Promise((resolve) => {
    box.replaceChildren();
    const form = document.createElement("form");
    form.id = "signin";
    const label = document.createElement("label");
    label.textContent = `${message} Token: `;
    const input = document.createElement("input");
    input.type = "password";
    input.autocomplete = "current-password";
    input.required = true;
    const button = document.createElement("button");
    button.type = "submit";
    button.textContent = "Sign in";
    label.append(input);
    form.append(label, " ", button);
    form.addEventListener("submit", async (e) => {
      e.preventDefault();
      if (await openSession(input.value)) {
        box.replaceChildren();
        box.hidden = true;
        resolve();
      } else {
        label.firstChild.textContent = "That token was refused. Token: ";
        input.select();
      }
    });
    box.append(form);
    box.hidden = false;
    input.focus();
  });
}
