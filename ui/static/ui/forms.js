// Management forms: POST with the form's CSRF token through fetch, show the answer next to the
// control (the API's error message, e.g. "capacity=4"), ask before destructive actions.

export function errorText(body, status) {
  if (body && body.error) return `${status} ${body.error.type}: ${body.error.message}`;
  return `${status}: unexpected answer`;
}

// Returns whether the server accepted the action.
export async function submitAction(form, submitter, describe) {
  // The answer shows in the form's own output, else in that of the panel holding it (data-messages).
  const output = form.querySelector("output.msg") ||
    (form.closest("[data-messages]") || form.parentElement).querySelector("output.msg");
  const question = (submitter && submitter.dataset.confirm) || form.dataset.confirm;
  if (question && !window.confirm(question)) return false;
  const data = new FormData(form, submitter || undefined);
  if (output) { output.textContent = "working…"; output.className = "msg busy"; }
  let response, body = null;
  try {
    response = await fetch(form.action, {method: "POST", body: data, credentials: "same-origin",
                                         headers: {"Accept": "application/json"}});
    body = await response.json().catch(() => null);
  } catch (err) {
    if (output) { output.textContent = `network error: ${err}`; output.className = "msg error"; }
    return false;
  }
  if (!output) return response.ok;
  if (response.ok) {
    output.textContent = describe ? describe(body.result) : "done";
    output.className = "msg ok";
  } else {
    output.textContent = errorText(body, response.status);
    output.className = "msg error";
  }
  return response.ok;
}
