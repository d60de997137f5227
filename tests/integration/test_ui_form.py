"""The Prefect UI as a user sees it, in headless Chromium against a real server and worker.

* The Custom run form of ``opd-distill/nightly`` renders ``PipelineSpec`` with help text on every
  config field, refuses a bad adapter name inline (the schema's ``pattern``), and what it submits
  reaches the run.
* A run's page tells the story in its Logs tab (stages, training steps, checkpoints, summary) and its
  artifacts render: the loss-curve chart is an image with a non-zero size, the receipt is one compact
  table, the outputs list starts with adapter, receipt and ``latest.json``.
* A rejected spec fails its run with one line naming the field and no traceback.

Screenshots of each page are kept under the test's temporary directory (the path is printed).
"""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path

import pytest

from .conftest import POOL, pipeline_spec
from .server import wait_for

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.browser]

EDITED_ADAPTER = "ui-edited-adapter"
BAD_ADAPTER = "my adapter/v2!"


@pytest.fixture
def screenshots(tmp_path) -> Path:
    """Where this test's screenshots are kept (under pytest's temporary directory for the test)."""
    folder = tmp_path / "screenshots"
    folder.mkdir()
    print(f"screenshots: {folder}")
    return folder


def _binary(*names: str) -> str | None:
    for name in names:
        found = shutil.which(name)
        if found:
            return found
    return None


@pytest.fixture
def browser(tmp_path):
    """Headless chromium with a throwaway profile. Without chromium or chromedriver the test is skipped
    on a developer machine, and fails in CI (``CI=true``): CI must not go green without running it."""
    chromium = _binary("chromium", "chromium-browser")
    chromedriver = _binary("chromedriver")
    if chromium is None or chromedriver is None:
        reason = "needs Debian's chromium and chromium-driver (apt-get install chromium chromium-driver)"
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(f"CI=true: {reason}")
        pytest.skip(reason)
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = chromium
    for argument in (
        "--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
        "--disable-background-networking", "--disable-component-update", "--disable-sync", "--no-first-run",
        f"--user-data-dir={tmp_path / 'chromium-profile'}", "--window-size=1400,2400",
    ):
        options.add_argument(argument)
    driver = webdriver.Chrome(service=Service(chromedriver), options=options)
    driver.set_page_load_timeout(180)
    try:
        yield driver
    finally:
        driver.quit()


@pytest.fixture
def paused_pool(live_server):
    """Pause the ``gpu`` pool so the form's run stays Scheduled; resume it afterwards."""
    live_server.api("PATCH", f"/work_pools/{POOL}", json={"is_paused": True})
    yield
    live_server.api("PATCH", f"/work_pools/{POOL}", json={"is_paused": False})


def _field_for(driver, label_text: str):
    """The control a form label points at (``<label for=…>``), by the label's exact text."""
    from selenium.webdriver.common.by import By

    label = driver.find_element(By.XPATH, f"//label[normalize-space()='{label_text}']")
    return driver.find_element(By.ID, label.get_attribute("for"))


def _text(driver) -> str:
    from selenium.webdriver.common.by import By

    return driver.find_element(By.TAG_NAME, "body").text


def _help_text(driver, label_text: str) -> str:
    """The text of the form row a label belongs to (label, help text, control, inline errors)."""
    from selenium.webdriver.common.by import By

    label = driver.find_element(By.XPATH, f"//label[normalize-space()='{label_text}']")
    return driver.execute_script(
        "let node = arguments[0];"
        "while (node.parentElement && !node.parentElement.querySelector('input, textarea, button[role=combobox]'))"
        "  node = node.parentElement;"
        "return node.parentElement ? node.parentElement.innerText : node.innerText;", label)


def _click_clear_of_toasts(driver, button) -> None:
    """Click ``button`` as a person would: once the notifications in the corner that cover it (e.g. the
    error toast of an earlier refused submit) have gone away."""
    from selenium.webdriver.common.by import By

    driver.execute_script("arguments[0].scrollIntoView({block: 'center'});", button)
    try:
        wait_for(lambda: not driver.find_elements(By.CSS_SELECTOR, "[data-sonner-toast][data-visible='true']"),
                 timeout=30, interval=0.5, what="the notifications to close")
    except TimeoutError:
        for close in driver.find_elements(By.CSS_SELECTOR, "[data-sonner-toast] button[aria-label='Close toast']"):
            close.click()
    button.click()


def test_custom_run_form_renders_spec_and_submits_edits(live_server, deployment, paused_pool, browser, screenshots):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys
    from selenium.webdriver.support import expected_conditions as ec
    from selenium.webdriver.support.ui import WebDriverWait

    page = f"{live_server.url}/v2/deployments/deployment/{deployment['id']}/run"
    browser.get(page)
    try:
        WebDriverWait(browser, 120).until(
            ec.presence_of_element_located((By.XPATH, "//label[normalize-space()='Adapter']"))
        )
    except Exception:
        browser.save_screenshot(str(screenshots / "form-timeout.png"))
        raise AssertionError(f"the run form never showed the Adapter field at {page}\n{live_server.tails()}") from None
    browser.save_screenshot(str(screenshots / "form-top.png"))

    # The PipelineSpec renders as nested groups, each titled, with help text from the field docstrings.
    labels = {element.text.strip() for element in browser.find_elements(By.TAG_NAME, "label")}
    for expected in ("Teacher (Optional)", "Kind (Optional)", "Path (Optional)", "Training data", "Examples", "Student",
                     "Storage Root (Optional)", "Adapter", "Training config (Kiln OpdConfig) (Optional)",
                     "Top K (Optional)", "ECHO (Optional)", "Distributed training (Optional)"):
        assert expected in labels, f"form label {expected!r} missing; labels: {sorted(labels)}"
    assert not any(label.startswith("Field") for label in labels), sorted(labels)
    # Off-policy: one source is filled (examples here), and no sampling setting is on the form.
    assert not {"Corpus (Optional)", "Examples (Optional)", "Corpus"} & labels
    sampling = {"Samples Per Prompt (Optional)", "Temperature (Optional)", "Top P (Optional)",
                "Max Tokens (Optional)", "Training Mode (Optional)"}
    assert not sampling & labels, sampling & labels
    form_text = _text(browser)
    assert "Output adapter name: 1-128 characters" in form_text
    assert "``" not in form_text  # no raw reST markup anywhere on the form
    top_k = browser.find_element(By.XPATH, "//label[normalize-space()='Top K (Optional)']")
    browser.execute_script("arguments[0].scrollIntoView({block: 'start'});", top_k)
    browser.save_screenshot(str(screenshots / "form-config-group.png"))
    for label, help_text in (("Top K (Optional)", "Teacher tokens per position the loss compares"),
                             ("Lora Rank (Optional)", "Kiln default: 16"),
                             ("Checkpoint Interval (Optional)", "every this many optimizer steps"),
                             ("Epochs (Optional)", "Passes over the corpus")):
        assert help_text in _help_text(browser, label), (label, _help_text(browser, label))

    # The teacher kind Literal is a dropdown offering the three kinds, set to the yaml's default.
    kind = _field_for(browser, "Kind (Optional)")
    assert kind.text.strip() == "local_dir"
    browser.execute_script("arguments[0].scrollIntoView({block: 'center'});", kind)
    kind.click()
    options = WebDriverWait(browser, 30).until(lambda d: d.find_elements(By.XPATH, "//*[@role='option']"))
    offered = {(option.get_attribute("textContent") or "").strip() for option in options}
    browser.save_screenshot(str(screenshots / "form-kind-dropdown.png"))
    assert {"kiln_server", "local_registry", "local_dir"} <= offered, (offered, [o.get_attribute("outerHTML") for o in options])
    browser.find_element(By.TAG_NAME, "body").send_keys(Keys.ESCAPE)
    WebDriverWait(browser, 30).until(lambda d: not d.find_elements(By.XPATH, "//*[@role='option']"))

    # The on-policy tab of the training data shows the prompts and their sampling settings instead.
    prompts_tab = browser.find_element(By.XPATH, "//*[self::button or @role='tab'][normalize-space()='Prompts (on-policy)']")
    browser.execute_script("arguments[0].scrollIntoView({block: 'center'});", prompts_tab)
    prompts_tab.click()
    WebDriverWait(browser, 30).until(lambda d: d.find_elements(By.XPATH, "//label[normalize-space()='Prompts']"))
    on_policy = {element.text.strip() for element in browser.find_elements(By.TAG_NAME, "label")}
    browser.save_screenshot(str(screenshots / "form-prompts-source.png"))
    assert sampling - {"Training Mode (Optional)"} <= on_policy, sorted(on_policy)
    assert "Examples" not in on_policy
    browser.get(page)  # back to the deployment's defaults (the examples source) for the edit below
    WebDriverWait(browser, 120).until(
        ec.presence_of_element_located((By.XPATH, "//label[normalize-space()='Adapter']")))

    def type_adapter(name: str):
        """Edit the adapter name the way a person does (select all, type)."""
        adapter = _field_for(browser, "Adapter")
        browser.execute_script("arguments[0].scrollIntoView({block: 'center'});", adapter)
        adapter.click()
        adapter.send_keys(Keys.CONTROL, "a")
        adapter.send_keys(Keys.BACKSPACE)
        adapter.send_keys(name)
        assert adapter.get_attribute("value") == name
        return adapter

    def press_submit():
        [submit] = browser.find_elements(By.XPATH, "//button[@type='submit' and normalize-space()='Submit']")
        _click_clear_of_toasts(browser, submit)

    before = {run["id"] for run in live_server.runs_of(deployment["id"])}
    assert _field_for(browser, "Adapter").get_attribute("value") == deployment["parameters"]["spec"]["adapter"]

    # A bad adapter name is refused inline, at the field, by the schema's pattern: no run is created.
    type_adapter(BAD_ADAPTER)
    press_submit()
    WebDriverWait(browser, 30).until(lambda d: "does not match" in _help_text(d, "Adapter"))
    browser.execute_script("arguments[0].scrollIntoView({block: 'center'});", _field_for(browser, "Adapter"))
    browser.save_screenshot(str(screenshots / "form-bad-adapter.png"))
    assert f"'{BAD_ADAPTER}' does not match" in _help_text(browser, "Adapter")
    toasts = [toast.text for toast in browser.find_elements(By.CSS_SELECTOR, "[data-sonner-toast]")]
    print(f"notifications after the refused submit: {toasts}")
    time.sleep(2)
    assert browser.current_url.endswith("/run"), "the form must stay open"
    assert {run["id"] for run in live_server.runs_of(deployment["id"])} <= before

    type_adapter(EDITED_ADAPTER)

    def created():
        runs = live_server.runs_of(deployment["id"])
        return [run for run in runs if run["id"] not in before and not run["auto_scheduled"]]

    # Under load the server's SQLite can answer the UI's create call with 503 (busy); the UI shows an
    # error toast and keeps the form, and a person presses Submit again. So does this test, at most 3 times.
    runs = []
    for attempt in range(3):
        submits = browser.find_elements(By.XPATH, "//button[@type='submit' and normalize-space()='Submit']")
        if not submits:
            break  # the UI already left the form: the run was created
        _click_clear_of_toasts(browser, submits[0])
        try:
            runs = wait_for(created, timeout=40, interval=1, what="the flow run the form submits")
            break
        except TimeoutError:
            browser.save_screenshot(str(screenshots / f"submit-{attempt}.png"))
    if not runs:
        try:
            runs = wait_for(created, timeout=20, interval=1, what="the flow run the form submits")
        except TimeoutError:
            raise AssertionError(f"no flow run was created; screenshots in {screenshots}\n{live_server.tails()}") from None
    run = runs[0]
    try:
        time.sleep(1)  # let the UI navigate back to the deployment page for the screenshot
        browser.save_screenshot(str(screenshots / "submitted.png"))
        spec = run["parameters"]["spec"]
        assert spec["adapter"] == EDITED_ADAPTER
        # Everything not edited came through unchanged from the deployment's defaults.
        defaults = deployment["parameters"]["spec"]
        assert (spec["teacher"]["kind"], spec["teacher"]["path"]) == ("local_dir", defaults["teacher"]["path"])
        assert spec["student"] == defaults["student"]
        assert spec["source"] == defaults["source"] == {"kind": "examples", "examples": "./kiln-data/demo-examples.jsonl"}
        assert spec["storage_root"] == defaults["storage_root"]
        assert spec["config"]["top_k"] == defaults["config"]["top_k"]
        # The optimizer union opened on the right tab (AdamW), so no Muon fields leaked into it.
        assert spec["config"]["optimizer"] == defaults["config"]["optimizer"]
        assert run["state"]["type"] == "SCHEDULED"
    finally:
        for submitted in created():  # a retried submit may have created more than one
            live_server.api("DELETE", f"/flow_runs/{submitted['id']}")


# ---------------------------------------------------------------------------------------------
# the run page


def _wait_for_text(driver, url: str, needles: tuple[str, ...], timeout: float = 90) -> str:
    """Load ``url`` until its text holds every needle (logs reach the API in batches); the text."""
    deadline = time.monotonic() + timeout
    while True:
        driver.get(url)
        try:
            wait_for(lambda: all(needle in _text(driver) for needle in needles), timeout=20, interval=1,
                     what=f"{needles} on {url}")
            return _text(driver)
        except TimeoutError:
            if time.monotonic() > deadline:
                missing = [needle for needle in needles if needle not in _text(driver)]
                raise AssertionError(f"{url} never showed {missing}:\n{_text(driver)[-3000:]}") from None


def _artifacts_of(live_server, flow_run_id: str) -> dict[str, dict]:
    body = {"artifacts": {"flow_run_id": {"any_": [flow_run_id]}}}
    return {artifact["key"]: artifact for artifact in live_server.api("POST", "/artifacts/filter", json=body)}


def test_run_page_tells_the_story_and_its_artifacts_render(live_server, deployment, worker, pipeline_inputs, browser,
                                                           screenshots):
    from selenium.webdriver.common.by import By

    adapter = "itest-ui-story"
    spec = pipeline_spec(pipeline_inputs, pipeline_inputs["short_corpus"], adapter, checkpoint_interval=2)
    run = live_server.create_run(deployment, {"spec": spec}, name="typed-in-the-form")
    final = live_server.wait_for_state(run["id"], {"COMPLETED"}, timeout=600)
    assert final["state"]["type"] == "COMPLETED", f"{final['state']}\n{live_server.tails()}"
    assert final["name"] == "typed-in-the-form" and f"adapter:{adapter}" in final["tags"]

    # The Logs tab tells the story: each stage, training steps with loss, rate and ETA, the
    # checkpoint, the receipt, one summary line -- and no per-stage "Finished in state Completed()".
    page = f"{live_server.url}/v2/runs/flow-run/{run['id']}?tab=Logs"
    text = _wait_for_text(browser, page, ("manifest: teacher", "admit: 4 examples", "materialize:", "train step 1/",
                                          "checkpoint published:", "publish: adapter", f"summary: {adapter} success"))
    browser.save_screenshot(str(screenshots / "run-page-logs.png"))
    assert "typed-in-the-form" in text and f"adapter:{adapter}" in text
    assert "action tok/s, ETA" in text
    assert "train_receipt.json" in text
    assert text.count("Finished in state Completed()") == 1, "only the flow's own completion line"

    artifacts = _artifacts_of(live_server, run["id"])
    keys = {"loss": f"loss-curve-{adapter}", "receipt": f"receipt-{adapter}", "outputs": f"outputs-{adapter}"}
    assert set(keys.values()) <= set(artifacts), sorted(artifacts)

    # The loss curve renders as an image with a real size (the markdown sanitizer keeps data: images).
    browser.get(f"{live_server.url}/v2/artifacts/artifact/{artifacts[keys['loss']]['id']}")
    image = wait_for(lambda: browser.find_elements(By.CSS_SELECTOR, "img[alt='loss curve']"), timeout=60,
                     what="the loss-curve image")[0]
    size = wait_for(lambda: browser.execute_script(
        "const r = arguments[0].getBoundingClientRect();"
        "return arguments[0].complete && arguments[0].naturalWidth > 0 && r.width > 0 && r.height > 0"
        "  ? [arguments[0].naturalWidth, r.width, r.height] : null;", image), timeout=30, what="the image's size")
    browser.save_screenshot(str(screenshots / "artifact-loss-curve.png"))
    assert size[0] > 0 and size[1] > 100 and size[2] > 50, size
    assert "lowest" in _text(browser) and "steps" in _text(browser)

    # The receipt is one compact table with the loss to 4 digits.
    text = _wait_for_text(browser, f"{live_server.url}/v2/artifacts/artifact/{artifacts[keys['receipt']]['id']}",
                          ("final loss", "learning rate", "optimizer", "LoRA rank / alpha", "corpus sha256"))
    browser.save_screenshot(str(screenshots / "artifact-receipt.png"))
    receipt = next(row for row in _table(artifacts[keys["receipt"]]) if row["field"] == "final loss")
    assert len(receipt["value"].split(".")[1]) == 4 and receipt["value"] in text
    assert "Page 1 of 1" in text

    # The outputs list starts with the adapter, the receipt and latest.json; checkpoints collapse.
    _wait_for_text(browser, f"{live_server.url}/v2/artifacts/artifact/{artifacts[keys['outputs']]['id']}",
                   ("newest checkpoint",))
    browser.save_screenshot(str(screenshots / "artifact-outputs.png"))
    items = [item.text for item in browser.find_elements(By.XPATH, "//li[strong]")]
    assert [item.split(":")[0] for item in items[:3]] == ["adapter", "receipt", "latest.json"], items


def _table(artifact: dict) -> list[dict]:
    import json

    data = artifact["data"]
    return json.loads(data) if isinstance(data, str) else data


def test_a_rejected_spec_fails_the_run_in_one_line(live_server, deployment, worker, pipeline_inputs, browser,
                                                   screenshots):
    spec = pipeline_spec(pipeline_inputs, pipeline_inputs["short_corpus"], "itest-ui-rejected")
    spec["student"] = str(pipeline_inputs["storage_root"] / "no-such-student")
    run = live_server.create_run(deployment, {"spec": spec}, name="itest-ui-rejected")
    final = live_server.wait_for_state(run["id"], {"FAILED"}, timeout=300)
    message = final["state"]["message"]
    assert final["state"]["type"] == "FAILED" and "\n" not in message, message
    assert "spec.student: " in message and "is not a directory" in message

    text = _wait_for_text(browser, f"{live_server.url}/v2/runs/flow-run/{run['id']}?tab=Logs",
                          ("spec.student:", "Finished in state Failed"))
    browser.save_screenshot(str(screenshots / "run-page-rejected.png"))
    assert "Traceback" not in text and "TokenizationError" not in text
    assert final["run_count"] <= 1, "a rejection is never retried"
