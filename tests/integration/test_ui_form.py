"""The Prefect UI as a user sees it, in headless Chromium against a real server and worker.

* The Custom run form of ``opd-distill/nightly`` renders ``PipelineSpec`` as fields (no JSON editor)
  in both of Prefect's UIs: the old one (V1, ``/deployments/…``) and the one the root opens (V2,
  ``/v2/…``), with help text on every config field that reads the same in both (no raw backticks, no
  vanished ``<placeholders>``) and switches named in words; the prompts kind of the training data
  submits an on-policy spec; the learning rate takes no letters and reaches the run as typed
  (``1e-5`` in V2; V1's number box cannot take an exponent and the form refuses the gap under the field
  instead of running with the default); samples per prompt shows empty for Kiln's auto-scaling; 0 is
  refused where Kiln needs a positive number.
* A run's page tells the story in its Logs tab (stages, training steps, checkpoints, summary) and its
  artifacts render: the loss-curve chart is an image with a non-zero size, the receipt is one compact
  table, the outputs list starts with adapter, receipt and ``latest.json``.
* A rejected spec fails its run with one line naming the field as the form does, once, at ERROR (the
  UI's "Error and above" filter shows it), with no traceback and no "unexpected exception", the adapter
  tag and a ``rejected-<adapter>`` artifact. A run that trains and fails (the publish guard refuses a
  diverged run) is told the same way, with a ``failed-<adapter>`` artifact, and its receipt table names
  the code its log names.
* Every link kiln-flows and Prefect print opens the UI the server's root opens, never ``…/api``; the
  deployment page shows the schedule's time zone.

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


# The new UI's navigation, present on every page it renders (its "Page not found" included).
UI_SHELL = ("Dashboard", "Deployments", "Work Pools", "Switch to V1 UI")


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
    _click_uncovered(driver, button)


def _click_uncovered(driver, button, attempts: int = 3) -> None:
    """Click ``button``; when something still lies over it (an open dropdown's list, a field's popover),
    close it as a person would (Escape, or a click on the page's empty margin), re-centre and try again."""
    from selenium.common.exceptions import ElementClickInterceptedException
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys

    for attempt in range(attempts):
        try:
            button.click()
            return
        except ElementClickInterceptedException:
            if attempt == attempts - 1:
                raise
            driver.find_element(By.TAG_NAME, "body").send_keys(Keys.ESCAPE)
            time.sleep(0.5)
            driver.execute_script("arguments[0].scrollIntoView({block: 'center'});", button)


def _wait_for_form(driver, page: str, screenshots: Path, name: str, label_xpath: str) -> None:
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support import expected_conditions as ec
    from selenium.webdriver.support.ui import WebDriverWait

    driver.get(page)
    try:
        WebDriverWait(driver, 120).until(ec.presence_of_element_located((By.XPATH, label_xpath)))
    except Exception:
        driver.save_screenshot(str(screenshots / f"{name}-timeout.png"))
        raise AssertionError(f"the run form never showed the Adapter field at {page}") from None


def _no_json_editor(driver) -> list[str]:
    """The JSON editors on the page (V2: CodeMirror; V1: prefect-design's code/JSON input)."""
    from selenium.webdriver.common.by import By

    found = driver.find_elements(By.CSS_SELECTOR, ".cm-editor, .p-code-input, [class*='schema-form-property-json'], "
                                                  "[class*='json-input']")
    return [element.get_attribute("class") for element in found]


def _created_runs(live_server, deployment, before: set[str]) -> list[dict]:
    return [run for run in live_server.runs_of(deployment["id"]) if run["id"] not in before and not run["auto_scheduled"]]


def _submit_until_created(driver, live_server, deployment, before: set[str], screenshots: Path, name: str) -> dict:
    """Press Submit (at most 3 times: under load the server's SQLite can answer the UI's create call with
    503, the UI keeps the form with an error toast and a person presses Submit again); the created run."""
    from selenium.webdriver.common.by import By

    runs = []
    for attempt in range(3):
        submits = driver.find_elements(By.XPATH, "//button[@type='submit' and normalize-space()='Submit']")
        if not submits:
            break  # the UI already left the form: the run was created
        _click_clear_of_toasts(driver, submits[0])
        try:
            runs = wait_for(lambda: _created_runs(live_server, deployment, before), timeout=40, interval=1,
                            what="the flow run the form submits")
            break
        except TimeoutError:
            driver.save_screenshot(str(screenshots / f"{name}-submit-{attempt}.png"))
    if not runs:
        try:
            runs = wait_for(lambda: _created_runs(live_server, deployment, before), timeout=20, interval=1,
                            what="the flow run the form submits")
        except TimeoutError:
            raise AssertionError(f"no flow run was created; screenshots in {screenshots}\n{live_server.tails()}") from None
    return runs[0]


def test_custom_run_form_renders_spec_and_submits_edits(live_server, deployment, paused_pool, browser, screenshots):
    """The new UI (V2, ``/v2/…``): fields for every group, the prompts kind with its sampling settings,
    0 refused where Kiln needs a positive number, and what it submits reaches the run."""
    from kiln_core.contracts.pipeline import parse_spec
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys
    from selenium.webdriver.support.ui import WebDriverWait

    page = f"{live_server.url}/v2/deployments/deployment/{deployment['id']}/run"
    adapter_label = "//label[normalize-space()='Adapter']"
    _wait_for_form(browser, page, screenshots, "v2-form", adapter_label)
    browser.save_screenshot(str(screenshots / "v2-form-top.png"))

    # The PipelineSpec renders as nested groups, each titled, with help text from the field docstrings,
    # and no JSON editor: the training data and the optimizer are a Kind dropdown plus fields.
    labels = {element.text.strip() for element in browser.find_elements(By.TAG_NAME, "label")}
    # Number fields are required (a value the form cannot read is refused, never replaced by a default), so
    # they carry no "(Optional)".
    for expected in ("Teacher (Optional)", "Kind (Optional)", "Path (Optional)", "Training data", "Corpus (Optional)",
                     "Examples (Optional)", "Prompts (Optional)", "Student", "Storage Root (Optional)", "Adapter",
                     "Training config (Kiln OpdConfig) (Optional)", "Top K", "Learning Rate",
                     "Optimizer (Optional)", "Beta1", "Momentum", "ECHO (Optional)",
                     "Distributed training (Optional)"):
        assert expected in labels, f"form label {expected!r} missing; labels: {sorted(labels)}"
    assert not any(label.startswith("Field") for label in labels), sorted(labels)
    assert _no_json_editor(browser) == []
    # Off-policy (the yaml's examples): no sampling setting is on the form until the prompts kind asks for it.
    sampling = {"Samples Per Prompt", "Temperature", "Top P", "Max Tokens", "Training Mode (Optional)"}
    assert not sampling & labels, sampling & labels
    form_text = _text(browser)
    assert "Output adapter name: 1-128 characters" in form_text and "adam_w only: " in form_text
    assert "``" not in form_text and "(?!" not in form_text  # no raw reST markup, no regular expression
    # Descriptions read as written: no raw backticks (V2 shows them), placeholders that survive V1's HTML
    assert "`" not in form_text and "registered with kiln-flows teachers register" in form_text
    assert "only a promoted adapter moves runs/ADAPTER/latest.json" in form_text
    # Optional groups switch between the group and None, named by the group's title, not a class name
    tabs = {tab.text.strip() for tab in browser.find_elements(By.XPATH, "//button[@role='tab']")}
    assert {"Promotion gate (Kiln post_eval)", "Quality gate (held-out metrics)", "Held-out watch during training"} <= tabs
    assert not {"PostEvalConfig", "QualityGate", "EvalWatch"} & tabs, sorted(tabs)
    top_k = browser.find_element(By.XPATH, "//label[normalize-space()='Top K']")
    browser.execute_script("arguments[0].scrollIntoView({block: 'start'});", top_k)
    browser.save_screenshot(str(screenshots / "v2-form-config-group.png"))
    for label, help_text in (("Top K", "Teacher tokens per position the loss compares"),
                             ("Lora Rank", "Kiln default: 16"),
                             ("Checkpoint Interval", "every this many optimizer steps"),
                             ("Epochs", "Passes over the corpus")):
        assert help_text in _help_text(browser, label), (label, _help_text(browser, label))

    # The teacher kind Literal is a dropdown offering the kinds, set to the yaml's default.
    kind = _field_for(browser, "Kind (Optional)")
    assert kind.text.strip() == "local_dir"
    browser.execute_script("arguments[0].scrollIntoView({block: 'center'});", kind)
    kind.click()
    options = WebDriverWait(browser, 30).until(lambda d: d.find_elements(By.XPATH, "//*[@role='option']"))
    offered = {(option.get_attribute("textContent") or "").strip() for option in options}
    browser.save_screenshot(str(screenshots / "v2-form-kind-dropdown.png"))
    assert {"kiln_server", "local_registry", "local_dir"} <= offered, offered
    browser.find_element(By.TAG_NAME, "body").send_keys(Keys.ESCAPE)
    WebDriverWait(browser, 30).until(lambda d: not d.find_elements(By.XPATH, "//*[@role='option']"))

    # Training data → Kind: prompts; the examples cleared, a prompts file typed, the sampling group opened.
    source_kind = _fields_for(browser, "Kind (Optional)")[1]
    assert source_kind.text.strip() == "examples"
    browser.execute_script("arguments[0].scrollIntoView({block: 'center'});", source_kind)
    source_kind.click()
    WebDriverWait(browser, 30).until(lambda d: d.find_elements(By.XPATH, "//*[@role='option'][normalize-space()='prompts']"))[0].click()
    WebDriverWait(browser, 30).until(lambda d: _fields_for(d, "Kind (Optional)")[1].text.strip() == "prompts")
    _toggle(browser, "Examples (Optional)", "None")
    _toggle(browser, "Prompts (Optional)", "str")
    prompts_box = WebDriverWait(browser, 30).until(lambda d: _row_input(d, "Prompts (Optional)"))
    prompts_box.send_keys("./kiln-data/prompts.jsonl")
    _toggle(browser, "Sampling (prompts only) (Optional)", "Sampling (prompts only)")
    WebDriverWait(browser, 30).until(lambda d: d.find_elements(By.XPATH, "//label[normalize-space()='Temperature']"))
    on_policy = {element.text.strip() for element in browser.find_elements(By.TAG_NAME, "label")}
    browser.execute_script("arguments[0].scrollIntoView({block: 'start'});", prompts_box)
    browser.save_screenshot(str(screenshots / "v2-form-prompts-source.png"))
    assert sampling - {"Training Mode (Optional)"} <= on_policy, sorted(on_policy)
    # Samples per prompt shows what runs: no number (Kiln's auto-scaling, 64 per prompt for a few prompts), not 4
    samples = _row_input(browser, "Samples Per Prompt")
    assert samples is None or samples.get_attribute("value") == ""
    assert "64 per prompt below 50 prompts" in _help_text(browser, "Samples Per Prompt")

    def type_into(label: str, text: str):
        return _retype(browser, _row_input(browser, label), text)

    # Letters do not go into the learning rate: it is a number field (what a person typed is not dropped
    # silently into a text parameter); a small number in exponent form does, as typed.
    assert type_into("Learning Rate", "abc") in ("", None)
    assert type_into("Learning Rate", "1e-5") == "1e-5"
    before = {run["id"] for run in live_server.runs_of(deployment["id"])}
    assert type_into("Adapter", EDITED_ADAPTER) == EDITED_ADAPTER

    # Top K 0 is refused under the field (exclusiveMinimum 0), and no run is created.
    assert type_into("Top K", "0") == "0"
    [submit] = browser.find_elements(By.XPATH, "//button[@type='submit' and normalize-space()='Submit']")
    _click_clear_of_toasts(browser, submit)
    WebDriverWait(browser, 30).until(lambda d: "minimum of 0" in _help_text(d, "Top K"))
    browser.execute_script("arguments[0].scrollIntoView({block: 'center'});", _row_input(browser, "Top K"))
    browser.save_screenshot(str(screenshots / "v2-form-top-k-zero.png"))
    time.sleep(2)
    assert browser.current_url.endswith("/run") and _created_runs(live_server, deployment, before) == []
    # A cleared number is refused under its field too, never sent as "use the default"
    assert type_into("Top K", "") == ""
    _click_clear_of_toasts(browser, submit)
    WebDriverWait(browser, 30).until(lambda d: "'top_k' is a required property" in _help_text(d, "Top K"))
    browser.save_screenshot(str(screenshots / "v2-form-top-k-cleared.png"))
    assert _created_runs(live_server, deployment, before) == []
    assert type_into("Top K", "16") == "16"

    run = _submit_until_created(browser, live_server, deployment, before, screenshots, "v2")
    try:
        time.sleep(1)
        browser.save_screenshot(str(screenshots / "v2-submitted.png"))
        spec = run["parameters"]["spec"]
        assert spec["adapter"] == EDITED_ADAPTER and spec["config"]["learning_rate"] == 1e-5
        assert spec["source"]["kind"] == "prompts" and spec["source"]["prompts"] == "./kiln-data/prompts.jsonl"
        # Everything not edited came through unchanged from the deployment's defaults.
        defaults = deployment["parameters"]["spec"]
        assert (spec["teacher"]["kind"], spec["teacher"]["path"]) == ("local_dir", defaults["teacher"]["path"])
        assert spec["student"] == defaults["student"] and spec["storage_root"] == defaults["storage_root"]
        assert spec["config"]["optimizer"]["kind"] == "adam_w"
        # What arrived is an on-policy spec with the yaml's optimizer: the run would train on the prompts.
        parsed = parse_spec(spec)
        assert (parsed.config.training_mode, parsed.prompts, parsed.examples) == ("on_policy", "./kiln-data/prompts.jsonl", None)
        assert parsed.config.optimizer == parse_spec(defaults).config.optimizer and parsed.config.top_k == 16
        assert run["state"]["type"] == "SCHEDULED"
    finally:
        for submitted in _created_runs(live_server, deployment, before):  # a retried submit may have made more
            live_server.api("DELETE", f"/flow_runs/{submitted['id']}")


def test_default_ui_form_renders_fields_and_submits_the_prompts_kind(live_server, deployment, paused_pool, browser,
                                                                     screenshots):
    """Prefect 3.9's default UI (V1, what the links kiln-flows prints open): the training data and the
    optimizer are fields, not JSON editors, and the prompts kind submits an on-policy spec."""
    from kiln_core.contracts.pipeline import parse_spec
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import Select, WebDriverWait

    page = f"{live_server.url}/deployments/deployment/{deployment['id']}/run"
    _wait_for_form(browser, page, screenshots, "v1-form", _v1_label("Adapter"))
    time.sleep(1)
    browser.save_screenshot(str(screenshots / "v1-form-top.png"))
    labels = {element.text.strip() for element in
              browser.find_elements(By.CSS_SELECTOR, ".schema-form-property__label")}
    for expected in ("Teacher (Optional)", "Training data", "Kind (Optional)", "Corpus (Optional)",
                     "Examples (Optional)", "Prompts (Optional)", "Sampling (prompts only) (Optional)", "Adapter",
                     "Training config (Kiln OpdConfig) (Optional)", "Learning Rate",
                     "Optimizer (Optional)", "Beta1", "Momentum", "Run options (Optional)"):
        assert expected in labels, f"V1 form label {expected!r} missing; labels: {sorted(labels)}"
    assert _no_json_editor(browser) == []
    # V1 renders descriptions as HTML: a <placeholder> would vanish ("runs//latest.json"); none is left
    form_text = _text(browser)
    assert "only a promoted adapter moves runs/ADAPTER/latest.json" in form_text and "runs//" not in form_text
    assert "`" not in form_text and "registered with kiln-flows teachers register" in form_text
    buttons = {button.text.strip() for button in browser.find_elements(By.TAG_NAME, "button")}
    assert {"Promotion gate (Kiln post_eval)", "Quality gate (held-out metrics)"} <= buttons, sorted(buttons)
    assert not {"PostEvalConfig", "QualityGate", "EvalWatch"} & buttons

    training_data = _v1_property(browser, "Training data")
    kind = Select(next(select for select in training_data.find_elements(By.TAG_NAME, "select")
                       if select.find_elements(By.TAG_NAME, "option")))
    assert [option.text for option in kind.options] == ["corpus", "examples", "prompts"]
    assert kind.first_selected_option.text == "examples"
    try:
        kind.select_by_value("prompts")
    except Exception:  # prefect-design styles the native select; choose as the keyboard would
        browser.execute_script("arguments[0].value = 'prompts'; arguments[0].dispatchEvent(new Event('change'));",
                               kind._el)
    assert kind.first_selected_option.text == "prompts"
    _v1_toggle(browser, "Examples (Optional)", "None")
    _v1_toggle(browser, "Prompts (Optional)", "str")
    prompts_box = WebDriverWait(browser, 30).until(lambda d: _v1_input(d, "Prompts (Optional)"))
    prompts_box.send_keys("./kiln-data/prompts.jsonl")
    _v1_toggle(browser, "Sampling (prompts only) (Optional)", "Sampling (prompts only)")
    # Samples per prompt shows what runs: no number (Kiln's auto-scaling, 64 per prompt for a few prompts), not 4
    samples = WebDriverWait(browser, 30).until(lambda d: _v1_property(d, "Samples Per Prompt"))
    assert "64 per prompt below 50 prompts" in samples.text
    assert [field.get_attribute("value") for field in samples.find_elements(By.TAG_NAME, "input")] in ([], [""])
    browser.execute_script("arguments[0].scrollIntoView({block: 'start'});", training_data)
    browser.save_screenshot(str(screenshots / "v1-form-prompts-source.png"))
    _v1_toggle(browser, "Sampling (prompts only) (Optional)", "None")

    def type_into(text: str) -> str:
        learning_rate = _v1_input(browser, "Learning Rate")
        assert learning_rate.get_attribute("type") == "number"
        return _retype(browser, learning_rate, text)

    assert type_into("abc") == ""  # letters are not taken
    # V1's number box drops the letter e ("1e-5" shows "1-5", which it cannot read): the form leaves the field
    # out, and a left-out number is refused under its field, never run with the optimizer's default.
    assert type_into("1e-5") == ""
    before = {run["id"] for run in live_server.runs_of(deployment["id"])}
    [submit] = browser.find_elements(By.XPATH, "//button[@type='submit' and normalize-space()='Submit']")
    _click_clear_of_toasts(browser, submit)
    WebDriverWait(browser, 30).until(
        lambda d: "'learning_rate' is a required property" in _v1_property(d, "Learning Rate").text)
    browser.execute_script("arguments[0].scrollIntoView({block: 'center'});", _v1_input(browser, "Learning Rate"))
    browser.save_screenshot(str(screenshots / "v1-form-learning-rate-exponent-refused.png"))
    time.sleep(2)
    assert _created_runs(live_server, deployment, before) == []
    assert type_into("0.00001") == "0.00001"  # the same number in the form V1 takes
    optimizer = _v1_property(browser, "Optimizer (Optional)")
    browser.execute_script("arguments[0].scrollIntoView({block: 'start'});", optimizer)
    browser.save_screenshot(str(screenshots / "v1-form-optimizer.png"))

    run = _submit_until_created(browser, live_server, deployment, before, screenshots, "v1")
    try:
        time.sleep(1)
        browser.save_screenshot(str(screenshots / "v1-submitted.png"))
        spec = run["parameters"]["spec"]
        assert spec["source"]["kind"] == "prompts" and spec["source"]["prompts"] == "./kiln-data/prompts.jsonl"
        assert spec["config"]["learning_rate"] == 1e-5
        parsed = parse_spec(spec)
        assert (parsed.config.training_mode, parsed.prompts, parsed.examples) == ("on_policy", "./kiln-data/prompts.jsonl", None)
        assert parsed.config.optimizer == parse_spec(deployment["parameters"]["spec"]).config.optimizer
    finally:
        for submitted in _created_runs(live_server, deployment, before):
            live_server.api("DELETE", f"/flow_runs/{submitted['id']}")


# V1 (prefect-design) form helpers: each property is a `.p-label.schema-form-property` whose header
# holds `.schema-form-property__label`; a nullable field has a "str | None" button group.

def _v1_label(text: str) -> str:
    return f"//span[contains(@class, 'schema-form-property__label') and normalize-space()='{text}']"


def _v1_property(driver, label: str, index: int = 0):
    from selenium.webdriver.common.by import By

    spans = driver.find_elements(By.XPATH, _v1_label(label))
    return spans[index].find_element(
        By.XPATH, "./ancestor::div[contains(concat(' ', normalize-space(@class), ' '), ' schema-form-property ')][1]")


def _v1_toggle(driver, label: str, choice: str) -> None:
    from selenium.webdriver.common.by import By

    row = _v1_property(driver, label)
    button = row.find_element(By.XPATH, f".//button[normalize-space()='{choice}']")
    driver.execute_script("arguments[0].scrollIntoView({block: 'center'});", button)
    button.click()


def _retype(driver, field, text: str):
    """Edit a field the way a person does (select all, delete, type); the value the field keeps."""
    from selenium.webdriver.common.keys import Keys

    driver.execute_script("arguments[0].scrollIntoView({block: 'center'});", field)
    field.click()
    field.send_keys(Keys.CONTROL, "a")
    field.send_keys(Keys.BACKSPACE)
    field.send_keys(text)
    return field.get_attribute("value")


def _v1_input(driver, label: str):
    from selenium.webdriver.common.by import By

    row = _v1_property(driver, label)
    fields = row.find_elements(By.CSS_SELECTOR, "input:not([type=checkbox]), textarea")
    return fields[0] if fields else None


# V2 form helpers

def _fields_for(driver, label_text: str) -> list:
    """Every control a form label with this exact text points at, in page order."""
    from selenium.webdriver.common.by import By

    return [driver.find_element(By.ID, label.get_attribute("for"))
            for label in driver.find_elements(By.XPATH, f"//label[normalize-space()='{label_text}']")]


def _row(driver, label_text: str):
    """The form row (label, help text, controls) of the first label with this text."""
    from selenium.webdriver.common.by import By

    label = driver.find_element(By.XPATH, f"//label[normalize-space()='{label_text}']")
    # each field is a `div.group`: a header (label, help text, menu) and a fieldset (the controls)
    return label.find_element(By.XPATH, "./ancestor::div[contains(concat(' ', normalize-space(@class), ' '), ' group ')][1]")


def _toggle(driver, label_text: str, choice: str) -> None:
    """Click the ``choice`` tab of a nullable field's "str | None" switch."""
    from selenium.webdriver.common.by import By

    button = _row(driver, label_text).find_element(By.XPATH, f".//button[@role='tab'][normalize-space()='{choice}']")
    driver.execute_script("arguments[0].scrollIntoView({block: 'center'});", button)
    button.click()


def _row_input(driver, label_text: str):
    from selenium.webdriver.common.by import By

    fields = _row(driver, label_text).find_elements(By.CSS_SELECTOR, "input:not([type=checkbox]), textarea")
    return fields[0] if fields else None


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
    # the deployment's schedule zone is the deployment's tag, not the run's (it hid the adapter tag behind "+1")
    assert not [tag for tag in final["tags"] if tag.startswith("tz:")], final["tags"]

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


def _log_entries(live_server, flow_run_id: str) -> list[dict]:
    body = {"logs": {"flow_run_id": {"any_": [flow_run_id]}}, "limit": 200, "sort": "TIMESTAMP_ASC"}
    return live_server.api("POST", "/logs/filter", json=body)


def _log_lines(live_server, flow_run_id: str) -> list[str]:
    return [entry["message"] for entry in _log_entries(live_server, flow_run_id)]


def test_a_rejected_spec_fails_the_run_in_one_line(live_server, deployment, worker, pipeline_inputs, browser,
                                                   screenshots):
    from tasks.artifacts import artifact_key

    missing = str(pipeline_inputs["storage_root"] / "no-such-corpus.jsonl")
    cases = {  # what the form sent → the one line the run ends with
        "itest-ui-rejected": ({"source": {"kind": "corpus", "corpus": missing}},
                              f"rejected (file_not_found) spec.source.corpus: {missing} does not exist",
                              "no-such-corpus.jsonl does not exist"),
        "my adapter/v2!": ({}, "rejected (invalid_adapter_name) spec.adapter: 'my adapter/v2!' must be 1-128 "
                               "characters of letters, digits", "must be 1-128 characters"),
    }
    runs = {}
    for adapter, (change, _, _) in cases.items():
        spec = {**pipeline_spec(pipeline_inputs, pipeline_inputs["short_corpus"], adapter), **change}
        runs[adapter] = live_server.create_run(deployment, {"spec": spec}, name=f"itest-ui-rejected-{len(runs)}")
    for adapter, (_, expected, needle) in cases.items():
        run = runs[adapter]
        final = live_server.wait_for_state(run["id"], {"FAILED", "CRASHED", "COMPLETED"}, timeout=300)
        message = final["state"]["message"]
        assert final["state"]["type"] == "FAILED" and "\n" not in message, message
        assert message.startswith(expected), message
        assert "(?!" not in message and "SpecError" not in message and "field spec." not in message, message
        assert f"adapter:{adapter}" in final["tags"], final["tags"]
        assert final["run_count"] <= 1, "a rejection is never retried"
        artifact = _artifacts_of(live_server, run["id"]).get(artifact_key("rejected", adapter))
        assert artifact is not None and artifact["type"] == "markdown", sorted(_artifacts_of(live_server, run["id"]))
        assert "nothing was trained or published" in artifact["data"]
        # Told once: the run's final line; no task failure lines repeating it, no engine "crash" line.
        lines = wait_for(lambda: [line for line in _log_lines(live_server, run["id"]) if "Finished in state" in line],
                         timeout=60, what="the run's final log line") and _log_lines(live_server, run["id"])
        telling = [line for line in lines if needle in line]
        assert len(telling) == 1, lines
        assert not [line for line in lines if "unexpected exception" in line or "Traceback" in line], lines
        # told at ERROR, the one error of the run: the UI's "Error and above" filter shows exactly it
        errors = [entry["message"] for entry in _log_entries(live_server, run["id"]) if entry["level"] >= 40]
        assert errors == telling, errors

    run = runs["itest-ui-rejected"]
    text = _wait_for_text(browser, f"{live_server.url}/runs/flow-run/{run['id']}", ("Finished in state Failed",))
    browser.save_screenshot(str(screenshots / "v1-run-page-rejected.png"))
    assert "spec.source.corpus:" in text and "Traceback" not in text and "unexpected exception" not in text
    text = _wait_for_text(browser, f"{live_server.url}/v2/runs/flow-run/{run['id']}?tab=Logs", ("Finished in state Failed",))
    browser.save_screenshot(str(screenshots / "v2-run-page-rejected.png"))
    assert "spec.source.corpus:" in text and "Traceback" not in text and "unexpected exception" not in text


def test_a_run_the_publish_guard_refuses_is_told_once_with_its_code(live_server, deployment, worker, pipeline_inputs,
                                                                    browser, screenshots):
    """``learning_rate: 1e10`` trains and diverges; the guard refuses to publish it. The run ends Failed with
    one line naming ``training_diverged``, at ERROR, once (no traceback, no "Engine execution exited with
    unexpected exception"), a ``failed-<adapter>`` artifact shaped like a rejection's, and a receipt table
    that names the same code (the receipt file keeps Kiln's ``training_error``)."""
    adapter = "itest-ui-diverged"
    spec = pipeline_spec(pipeline_inputs, pipeline_inputs["short_corpus"], adapter)
    spec["config"]["learning_rate"] = 1e10
    run = live_server.create_run(deployment, {"spec": spec}, name="itest-ui-diverged")
    final = live_server.wait_for_state(run["id"], {"FAILED", "CRASHED", "COMPLETED"}, timeout=600)
    message = final["state"]["message"]
    assert final["state"]["type"] == "FAILED" and message.startswith("failed (training_diverged): the publish guard"), \
        message
    wait_for(lambda: [line for line in _log_lines(live_server, run["id"]) if "Finished in state" in line], timeout=60,
             what="the run's final log line")
    entries = _log_entries(live_server, run["id"])
    telling = [entry for entry in entries if "training_diverged" in entry["message"]]
    assert [entry["level"] for entry in telling] == [40], [entry["message"][:120] for entry in telling]
    assert [entry["message"] for entry in entries if entry["level"] >= 40] == [telling[0]["message"]]
    assert not [entry for entry in entries if "Traceback" in entry["message"] or "unexpected exception" in entry["message"]]
    artifacts = _artifacts_of(live_server, run["id"])
    failed = artifacts.get(f"failed-{adapter}")
    assert failed is not None and failed["type"] == "markdown", sorted(artifacts)
    assert failed["data"].startswith("### Failed: nothing was published\n\n**training_diverged**\n\n")
    status = next(row for row in _table(artifacts[f"receipt-{adapter}"]) if row["field"] == "status")
    assert status["value"] == "failed (training_diverged; Kiln's failure_reason training_error)", status

    for ui, name in (("", "v1"), ("/v2", "v2")):
        text = _wait_for_text(browser, f"{live_server.url}{ui}/runs/flow-run/{run['id']}" + ("?tab=Logs" if ui else ""),
                              ("Finished in state Failed",))
        browser.save_screenshot(str(screenshots / f"{name}-run-page-diverged.png"))
        assert text.count("training_diverged") >= 1 and "Traceback" not in text and "unexpected exception" not in text
    browser.get(f"{live_server.url}/v2/artifacts/artifact/{failed['id']}")
    wait_for(lambda: "nothing was published" in _text(browser), timeout=60, what="the failed artifact")
    browser.save_screenshot(str(screenshots / "v2-artifact-failed.png"))


def test_printed_links_open_the_ui_the_root_opens_and_the_schedules_zone_shows(live_server, deployment, browser,
                                                                                 screenshots, pipeline_inputs,
                                                                                 tmp_path):
    """The root opens Prefect 3.9's new UI (``/v2``); the links ``kiln-flows serve`` and ``kiln-flows run``
    print (theirs and Prefect's "View at") open it too, not the old one, and none is the ``…/api``
    address (a browser shows "Page not found" there). The deployment page shows the schedule's zone."""
    import re
    import signal
    import subprocess
    import sys

    import yaml

    browser.get(live_server.url + "/")
    wait_for(lambda: "/v2/" in browser.current_url, timeout=60, what="the root to open a UI")
    kiln_flows = str(Path(sys.executable).with_name("kiln-flows"))
    proc = live_server.spawn("serve-links", [kiln_flows, "serve", "--name", "itest-links", "--cron", "0 4 * * *",
                                             "--timezone", "Asia/Tokyo", "--limit", "1"],
                             live_server.client_env(), cwd=tmp_path)
    try:
        wait_for(lambda: live_server.find_deployment("opd-distill", "itest-links"), timeout=180, interval=2,
                 what="the served deployment")
        time.sleep(3)  # Prefect prints its own link once the deployment exists
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=60)
    printed = (live_server.logs / "serve-links.log").read_text(encoding="utf-8", errors="replace")
    # a spec refused by its first task: the flow starts (and Prefect prints "View at …"), then exits 2 at once
    spec = pipeline_spec(pipeline_inputs, pipeline_inputs["storage_root"] / "missing.jsonl", "itest-links")
    spec_file = tmp_path / "refused.yaml"
    spec_file.write_text(yaml.safe_dump(spec), encoding="utf-8")
    done = subprocess.run([kiln_flows, "run", str(spec_file)], cwd=tmp_path, env=live_server.client_env(),
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 2, done.stdout + done.stderr
    printed += done.stdout + done.stderr
    links = sorted(set(re.findall(r"https?://[^\s'\"]+", printed)))
    assert links and not [link for link in links if "/api" in link], (links, printed[-2000:])
    assert [link for link in links if "/runs/flow-run/" in link] and [link for link in links if "/deployments" in link]
    for index, link in enumerate(links):
        browser.get(link.rstrip(".,)"))
        # The new UI's shell (its navigation) renders once the client router has matched the address, and a
        # "Page not found" renders inside that same shell; the page's own data (the dashboard's cards) may
        # take minutes on a loaded 2-core runner, so the shell is what is waited for, not an amount of text.
        try:
            wait_for(lambda: all(item in _text(browser) for item in UI_SHELL), timeout=150,
                     what=f"{link} to render the UI's navigation")
        except TimeoutError as error:
            raise AssertionError(f"{error}; at {browser.current_url} the page shows:\n{_text(browser)[-2000:]}") from None
        browser.save_screenshot(str(screenshots / f"printed-link-{index}.png"))
        assert "/v2/" in browser.current_url, (link, browser.current_url)
        assert "Page not found" not in _text(browser), link

    served = live_server.find_deployment("opd-distill", "itest-links")
    for ui, name in (("", "v1"), ("/v2", "v2")):
        text = _wait_for_text(browser, f"{live_server.url}{ui}/deployments/deployment/{served['id']}", ("Schedules",))
        browser.save_screenshot(str(screenshots / f"{name}-deployment-page-zone.png"))
        assert "Asia/Tokyo" in text, text[-2000:]
