"""A saved view of a sweep's runs in MLflow's UI: MLflow's own "Save view", written for the person who opens it.

MLflow 3 keeps a saved view as an experiment tag ``mlflow.sharedViewState.<key>``; ``?viewStateShareKey=<key>`` on
the runs list opens it, and the runs page's "Views" menu lists it by name. As read in the 3.17 UI bundle
(``useSharedExperimentViewState``, ``savedViewEnvelope``, ``ExperimentPageUIState``):

- the tag's value is a JSON envelope ``{"name", "createdAt", "updatedAt", "state"}`` (milliseconds), at most 20,000
  characters; ``state`` is the page state as JSON, or ``deflate;`` + base64 of its zlib stream (pako's deflate);
- the page state is the search facets (``searchFilter``, ``orderByKey``, ...) and the UI state: ``selectedColumns``
  (``params.`key```, ``metrics.`key```, ``tags.`key```), ``compareRunCharts`` and ``compareRunSections``,
  ``runsHiddenMode``, ...; the UI drops ``runsExpanded`` from a shared view, so children folded under their parent
  stay folded, and folded runs are neither listed nor charted. Any sort but the start time lists runs flat: the view
  sorts by a metric;
- the UI adds a chart for every metric no card names; a card marked ``deleted`` keeps one out.
"""

from __future__ import annotations

import base64
import json
import time
import zlib
from collections.abc import Iterable
from typing import Any

from hydraddp.tracking import names

SHARE_TAG_PREFIX = "mlflow.sharedViewState."
MAX_TAG_VALUE = 20000  # the UI's limit on a view, and the server's on an experiment tag
SECTION = "sweep"
THROUGHPUT, PEAK_MEMORY = names.SAMPLES_PER_S, f"{names.mib_key(names.PEAK_MEMORY)}/max"
BARS = (THROUGHPUT, PEAK_MEMORY, names.MFU)  # one value per run: compared side by side
CURVES = (names.LOSS, names.EVAL_LOSS)  # over steps
COLUMN_TAGS = (names.TAG_WRAP, names.TAG_PRECISION, names.TAG_MESH, names.TAG_WORLD_SIZE)
COLUMN_METRICS = (THROUGHPUT, names.MFU, PEAK_MEMORY, names.LOSS, names.EVAL_LOSS)


def column(group: str, key: str) -> str:
    """The UI's column and sort key (``makeCanonicalSortKey``): ``params.`optim.optimizer.lr```."""
    return f"{group}.`{key}`"


def view_key(parent_run_id: str) -> str:
    return f"hydraddp-{parent_run_id}"


def _card(kind: str, metric: str, number: int, deleted: bool = False) -> dict[str, Any]:
    card: dict[str, Any] = {"uuid": f"hydraddp-{number}", "type": kind, "runsCountToCompare": 100,
                            "metricSectionId": SECTION, "deleted": deleted, "isGenerated": False,
                            "metricKey": metric}
    if kind == "LINE":
        card.update({"selectedMetricKeys": [metric], "lineSmoothness": 0, "xAxisScaleType": "linear", "scaleType": "linear", "range": {},
                     "xAxisKey": "step", "selectedXAxisMetricKey": "", "yAxisKey": "metric", "yAxisExpressions": [],
                     "ignoreOutliers": False, "useGlobalXaxisKey": False, "useGlobalLineSmoothing": False})
    return card


def page_state(search_filter: str, params: Iterable[str], metric_keys: Iterable[str],
               hide_others: bool = True) -> dict[str, Any]:
    """The runs page as a sweep's view shows it: its runs flat, fastest first, with the columns and charts that
    compare them; ``params`` are the swept keys that are not config groups (``optim.optimizer.lr``). Every other
    metric of ``metric_keys`` is kept out of the charts unless ``hide_others`` is False."""
    cards = [_card("BAR", m, i) for i, m in enumerate(BARS)]
    cards += [_card("LINE", m, len(cards) + i) for i, m in enumerate(CURVES)]
    if hide_others:
        shown = set(BARS) | set(CURVES)
        cards += [_card("BAR", m, len(cards) + i, deleted=True)
                  for i, m in enumerate(sorted(set(metric_keys) - shown))]
    return {
        "searchFilter": search_filter, "orderByKey": column("metrics", THROUGHPUT), "orderByAsc": False,
        "startTime": "ALL", "lifecycleFilter": "Active", "modelVersionFilter": "All Runs", "datasetsFilter": [],
        "selectedColumns": [*(column("tags", t) for t in COLUMN_TAGS), *(column("params", p) for p in params),
                            *(column("metrics", m) for m in COLUMN_METRICS)],
        "columnOrder": [], "columnWidths": {},
        "runsHiddenMode": "SHOW_ALL",  # chart every run, not the first 10
        "compareRunCharts": cards,
        "compareRunSections": [{"uuid": SECTION, "name": "Sweep: throughput, memory, loss", "display": True,
                                "isReordered": False, "deleted": False, "isGenerated": False}],
        "viewMaximized": False, "runListHidden": False, "isAccordionReordered": False, "groupBy": None,
        "groupsExpanded": {}, "useGroupedValuesInCharts": True, "hideEmptyCharts": True,
        "globalLineChartConfig": {"xAxisKey": "step", "lineSmoothness": 0, "selectedXAxisMetricKey": ""},
        "chartsSearchFilter": "",
    }


def envelope(name: str, state: dict[str, Any], now_ms: int | None = None) -> str:
    """The tag's value: the UI's envelope around the compressed state, as its "Save view" writes it."""
    packed = zlib.compress(json.dumps(state, separators=(",", ":")).encode())
    now = now_ms if now_ms is not None else int(time.time() * 1000)
    return json.dumps({"name": name, "createdAt": now, "updatedAt": now,
                       "state": "deflate;" + base64.b64encode(packed).decode("ascii")}, separators=(",", ":"))


def read_state(value: str) -> dict[str, Any]:
    """The page state of a view's tag value, as the UI reads it back."""
    state = json.loads(value)["state"]
    if state.startswith("deflate;"):
        state = zlib.decompress(base64.b64decode(state.removeprefix("deflate;"))).decode()
    return json.loads(state)


def save_view(client: Any, experiment_id: str, parent_run_id: str, name: str, search_filter: str,
              params: Iterable[str], metric_keys: Iterable[str]) -> str:
    """Write the view of a sweep (its parent ``parent_run_id``) and return its key. A sweep with more metrics than
    fit leaves them in the charts rather than write no view."""
    params, metric_keys = list(params), list(metric_keys)
    value = envelope(name, page_state(search_filter, params, metric_keys))
    if len(value) > MAX_TAG_VALUE:
        value = envelope(name, page_state(search_filter, params, metric_keys, hide_others=False))
    key = view_key(parent_run_id)
    client.set_experiment_tag(experiment_id, SHARE_TAG_PREFIX + key, value)
    return key
