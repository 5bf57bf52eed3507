"""Issue 27 in a real browser: cases, their link, exports, the printed report, batches.

Same set-up as tests/test_console_browser.py (Debian's chromium through Playwright,
the app under uvicorn, tiny model, SQLite; a missing chromium fails). Screenshots of
the case view, the batch table and the printed report go to the test's tmp folder
and, when ``WORLDCUP_CONSOLE_SCREENSHOTS`` names a folder (``docs/console``), there
too: ``make console-screenshots`` regenerates them.
"""

from __future__ import annotations

import csv
import io
import json
import re
import shutil
from pathlib import Path
from typing import Any

import httpx
import pytest
from servers import LiveServer
from test_console_browser import (  # noqa: F401 - fixtures
    HUMAN_A,
    HUMAN_B,
    _tenant,
    acme,
    check,
    live,
    page,
    playwright_browser,
    screenshot,
    shots,
    sign_in,
)
from test_service_api import ADMIN, ADMIN_TOKEN

from app.services.cases import CSV_COLUMNS

pytestmark = pytest.mark.browser


def section_shot(locator: Any, folders: list[Path], name: str) -> None:
    """A screenshot of one part of the page (the batch table would be 200 rows long)."""
    first = folders[0] / name
    locator.screenshot(path=str(first))
    assert first.stat().st_size > 10_000
    for folder in folders[1:]:
        shutil.copyfile(first, folder / name)


def _secret(auth: dict[str, str]) -> str:
    return auth["Authorization"].split()[1]


def _case_rows(tab: Any) -> dict[str, str]:
    rows = tab.eval_on_selector_all(
        "[data-testid=case-table] tr",
        "trs => trs.map(tr => [tr.querySelector('th').textContent, "
        "tr.querySelector('td').textContent])",
    )
    return {str(k): str(v) for k, v in rows}


@pytest.fixture(scope="module")
def rival(live: LiveServer) -> dict[str, str]:  # noqa: F811
    """Another tenant, whose key must not open acme's cases."""
    _, auth = _tenant(live.url, "rival", 1271)
    return auth


def test_a_case_is_saved_reopened_by_its_link_and_refused_to_another_tenant(
    page: Any,  # noqa: F811
    live: LiveServer,  # noqa: F811
    acme: dict[str, Any],  # noqa: F811
    rival: dict[str, str],
    shots: list[Path],  # noqa: F811
) -> None:
    gen = acme["gen"]
    sign_in(page, _secret(acme["auth"]))
    page.get_by_test_id("keep-text").check()
    verdict = check(page, gen["text"])
    assert verdict.startswith("Watermarked — tenant acme")
    rule = page.get_by_test_id("verdict-rule").inner_text()
    assert "statistic below 1e-6" in rule and "keys searched: every tenant" in rule  # which, why
    report = page.get_by_test_id("case-report")
    assert report.is_visible()
    case_id = page.get_by_test_id("case-id").inner_text()
    link = page.get_by_test_id("case-link").get_attribute("href")
    assert link == f"{live.url}/console/cases/{case_id}"
    stored = httpx.get(f"{live.url}/console/api/cases/{case_id}", headers=acme["auth"]).json()
    assert stored["verdict"] == "watermarked" and stored["text"] == gen["text"]
    assert stored["who"]["tenant_name"] == "acme" and _secret(acme["auth"]) not in json.dumps(
        stored
    )
    history = page.get_by_test_id("history-table").locator("tbody tr").first
    history.filter(has_text=case_id).wait_for()

    # the link, in the same tab (the credential stays in this tab's session storage)
    page.goto(link)
    page.get_by_test_id("case-verdict").filter(has_text="Watermarked").wait_for()
    assert page.get_by_test_id("case-id").inner_text() == case_id
    assert page.get_by_test_id("case-text").inner_text() == gen["text"]
    rows = _case_rows(page)
    assert rows["message id"] == str(gen["message_id"])
    assert rows["text SHA-256"] == stored["text_sha256"]
    assert rows["checked by"].startswith('API key "') and "tenant acme" in rows["checked by"]
    assert page.get_by_test_id("text-input").is_visible()  # the workspace is there too
    screenshot(page, shots, "case.png")

    # another tenant's key, with the same link: refused, and nothing of the case shown
    page.get_by_test_id("sign-out").click()
    page.goto(link)
    sign_in(page, _secret(rival))
    error = page.get_by_test_id("case-error")
    error.filter(has_text="No such case").wait_for()
    assert gen["text"] not in page.content()
    assert page.get_by_test_id("case-table").locator("tr").count() == 0
    r = httpx.get(f"{live.url}/console/api/cases/{case_id}", headers=rival)
    assert r.status_code == 404 and gen["text"] not in r.text
    # and the admin opens it
    page.get_by_test_id("sign-out").click()
    page.goto(link)
    sign_in(page, ADMIN_TOKEN)
    page.get_by_test_id("case-verdict").filter(has_text="Watermarked").wait_for()


def test_case_exports_json_and_csv_and_prints_on_one_page(
    page: Any,  # noqa: F811
    acme: dict[str, Any],  # noqa: F811
    shots: list[Path],  # noqa: F811
    tmp_path: Path,
) -> None:
    sign_in(page, ADMIN_TOKEN)
    page.get_by_test_id("keep-text").check()
    check(page, HUMAN_A + acme["gen"]["text"] + HUMAN_B)
    case_id = page.get_by_test_id("case-id").inner_text()
    with page.expect_download() as info:
        page.get_by_test_id("case-export-json").click()
    download = info.value
    assert download.suggested_filename == f"case-{case_id}.json"
    exported = json.loads(Path(download.path()).read_text(encoding="utf-8"))
    assert exported["case_id"] == case_id and exported["who"]["role"] == "admin"
    assert exported["verdict"] == "watermarked"
    assert exported["statistic"] in ("detect", "decode", "registry")
    with page.expect_download() as info:
        page.get_by_test_id("case-export-csv").click()
    rows = list(csv.reader(io.StringIO(Path(info.value.path()).read_text(encoding="utf-8"))))
    assert rows[0] == list(CSV_COLUMNS) and len(rows) == 2
    assert dict(zip(rows[0], rows[1], strict=True))["case_id"] == case_id

    # the island spans: the report names the stretch the heatmap's summary names
    islands = page.get_by_test_id("islands").inner_text()
    spans = re.findall(r"(\d+)–(\d+) \(mean z", islands)
    assert len(spans) == 1, islands
    stretch = _case_rows(page)["watermarked stretches"]
    assert stretch.startswith(f"tokens {spans[0][0]}–{spans[0][1]} "), (stretch, islands)

    # the printed report: print media shows the case alone, and it fits one A4 page
    page.emulate_media(media="print")
    assert page.get_by_test_id("case-report").is_visible()
    for hidden in ("text-input", "run-provenance", "heatmap", "batch-file", "history-table"):
        assert page.get_by_test_id(hidden).is_hidden(), hidden
    assert page.get_by_test_id("case-export-json").is_hidden()
    assert page.locator(".print-only").first.is_visible()
    assert page.get_by_test_id("case-url-print").inner_text().endswith(f"/console/cases/{case_id}")
    screenshot(page, shots, "report-print.png")
    pdf = page.pdf(format="A4", print_background=True)
    pages = len(re.findall(rb"/Type\s*/Page[^s]", pdf))
    assert pages == 1, pages
    (tmp_path / "report.pdf").write_bytes(pdf)
    page.emulate_media(media="screen")
    assert page.get_by_test_id("text-input").is_visible()


def test_a_200_text_csv_batch_is_sorted_filtered_and_exported(
    page: Any,  # noqa: F811
    live: LiveServer,  # noqa: F811
    acme: dict[str, Any],  # noqa: F811
    shots: list[Path],  # noqa: F811
    tmp_path: Path,
) -> None:
    wm = acme["gen"]["text"]
    upload = tmp_path / "reports.csv"
    with open(upload, "w", encoding="utf-8", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["doc_id", "channel", "body"])
        for i in range(200):
            if i == 7:
                body = ""  # an empty report: its error row
            elif i % 4 == 0:
                body = wm
            else:
                body = f"Report {i}. " + (HUMAN_A if i % 2 else HUMAN_B)
            writer.writerow([f"doc-{i:03d}", "email" if i % 3 else "chat", body])
    sign_in(page, ADMIN_TOKEN)
    page.get_by_test_id("batch-file").set_input_files(str(upload))
    column = page.get_by_test_id("batch-column")
    page.get_by_test_id("batch-status").filter(has_text="choose the column").wait_for()
    assert column.locator("option").all_inner_texts() == ["doc_id", "channel", "body"]
    assert column.input_value() == "body"
    page.get_by_test_id("batch-run").click()
    status = page.get_by_test_id("batch-status")
    status.filter(has_text="Done: 200 rows").wait_for(timeout=240_000)
    assert "50 watermarked" in status.inner_text() and "1 errors" in status.inner_text()
    table = page.get_by_test_id("batch-table").locator("tbody tr")
    assert table.count() == 200
    assert page.get_by_test_id("batch-count").inner_text() == "Showing 200 of 200 rows."

    page.get_by_test_id("batch-filter-verdict").select_option("watermarked")
    assert page.get_by_test_id("batch-count").inner_text() == "Showing 50 of 200 rows."
    verdicts = page.eval_on_selector_all(
        "[data-testid=batch-table] tbody tr", "trs => trs.map(t => t.dataset.verdict)"
    )
    assert verdicts == ["watermarked"] * 50
    page.get_by_test_id("batch-filter-verdict").select_option("error")
    assert table.count() == 1 and "empty" in table.first.inner_text()
    page.get_by_test_id("batch-filter-verdict").select_option("")
    page.get_by_test_id("batch-filter-text").fill("reports.csv:1")  # ids: reports.csv:<row>
    assert page.get_by_test_id("batch-count").inner_text() == "Showing 111 of 200 rows."
    page.get_by_test_id("batch-filter-text").fill("reports.csv:12")  # rows 12, 120-129
    assert page.get_by_test_id("batch-count").inner_text() == "Showing 11 of 200 rows."
    shown = page.eval_on_selector_all(
        "[data-testid=batch-table] tbody tr", "trs => trs.map(t => t.cells[1].textContent)"
    )
    assert sorted(shown) == sorted(
        ["reports.csv:12", *(f"reports.csv:{i}" for i in range(120, 130))]
    )
    section_shot(page.locator("#batch"), shots, "batch.png")
    page.get_by_test_id("batch-filter-text").fill("")

    # sort by p: watermarked rows first, then descending puts them last
    page.locator("[data-testid=batch-table] button[data-sort=p]").click()
    assert page.locator("th[aria-sort=ascending] button[data-sort=p]").count() == 1
    assert table.first.get_attribute("data-verdict") == "watermarked"
    page.locator("[data-testid=batch-table] button[data-sort=p]").click()
    assert page.locator("th[aria-sort=descending] button[data-sort=p]").count() == 1
    assert table.first.get_attribute("data-verdict") == "error"  # no p: sorts as largest
    page.locator("[data-testid=batch-table] button[data-sort=row]").click()
    assert table.first.locator("td").first.inner_text() == "0"

    with page.expect_download() as info:
        page.get_by_test_id("batch-export-csv").click()
    rows = list(csv.reader(io.StringIO(Path(info.value.path()).read_text(encoding="utf-8"))))
    assert rows[0] == list(CSV_COLUMNS) and len(rows) == 1 + 199  # the error row has no case
    exported = [dict(zip(rows[0], r, strict=True)) for r in rows[1:]]
    assert sum(r["verdict"] == "watermarked" for r in exported) == 50
    assert {r["source"] for r in exported} == {"reports.csv"}

    # each row opens its case
    table.first.locator("a").click()
    page.get_by_test_id("case-verdict").filter(has_text="Watermarked").wait_for()
    assert "reports.csv, row 0" in _case_rows(page)["from"]
    assert "/console/cases/" in page.url

    # over the limit: a clear refusal that points to worldcup scan
    big = tmp_path / "big.jsonl"
    big.write_text("".join(json.dumps({"text": f"t {i}"}) + "\n" for i in range(201)))
    page.get_by_test_id("batch-file").set_input_files(str(big))
    page.get_by_test_id("batch-status").filter(has_text="choose the column").wait_for()
    page.get_by_test_id("batch-run").click()
    error = page.get_by_test_id("batch-error")
    error.filter(has_text="worldcup scan").wait_for()
    assert "at most 200" in error.inner_text()


def test_console_links_with_tracking_parameters_open_the_page(
    page: Any,  # noqa: F811
    live: LiveServer,  # noqa: F811
) -> None:
    for path in ("/console?utm_source=x", "/console/cases/AAAAAAAAAAAA?utm_source=x&ref=chat"):
        response = page.goto(live.url + path)
        assert response is not None and response.status == 200
        assert page.get_by_test_id("api-key").is_visible()
        assert "unknown_query_parameter" not in page.content()
    # the API routes still refuse unknown parameters
    r = httpx.get(f"{live.url}/console/api/cases?utm_source=x", headers=ADMIN)
    assert r.status_code == 422 and r.json()["error"]["code"] == "unknown_query_parameter"
