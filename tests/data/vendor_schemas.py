"""Regenerate the vendored schemas in this folder (not a test; needs the sources named in README.md).

    python tests/data/vendor_schemas.py k8s KUBERNETES_VALIDATE_WHEEL
    python tests/data/vendor_schemas.py kserve KSERVE_CRD_YAML
"""

import json
import sys
import zipfile
from pathlib import Path

HERE = Path(__file__).parent


def _refs(node, out):
    if isinstance(node, dict):
        ref = node.get("$ref")
        if isinstance(ref, str):
            out.add(ref.split("/")[-1])
        for v in node.values():
            _refs(v, out)
    elif isinstance(node, list):
        for v in node:
            _refs(v, out)


def k8s(wheel: str) -> None:
    """Deployment (apps/v1) and Service (v1) from kubernetes-validate's v1.33.0-local-strict schemas, with the
    closure of the definitions they reference in one file."""
    base = "kubernetes_validate/kubernetes-json-schema/v1.33.0-local-strict/"
    with zipfile.ZipFile(wheel) as z:
        defs = json.loads(z.read(base + "_definitions.json"))["$defs"]
        roots = {n: json.loads(z.read(base + f)) for n, f in (("Deployment", "deployment-apps-v1.json"),
                                                                ("Service", "service-v1.json"))}
    keep, todo = set(), set()
    for r in roots.values():
        _refs(r, todo)
    while todo:
        name = todo.pop()
        if name in keep:
            continue
        keep.add(name)
        found = set()
        _refs(defs[name], found)
        todo |= found - keep
    out = {"source": "kubernetes-validate 1.37.0 (PyPI), kubernetes-json-schema/v1.33.0-local-strict: "
                     "deployment-apps-v1.json, service-v1.json and the definitions they reference (generated from "
                     "the Kubernetes 1.33 OpenAPI; github.com/yannh/kubernetes-json-schema)",
           "roots": {k: {kk: vv for kk, vv in v.items() if kk != "$schema"} for k, v in roots.items()},
           "$defs": {k: defs[k] for k in sorted(keep)}}
    text = json.dumps(out, sort_keys=True, separators=(",", ":")).replace("/api/_definitions.json#/$defs/",
                                                                          "#/$defs/")
    (HERE / "k8s_1.33_deployment_service_schema.json").write_text(text)


def kserve(crd_yaml: str) -> None:
    """The InferenceService CRD's v1beta1 openAPIV3Schema, the predictor's per-framework specs left out."""
    import yaml
    crd = yaml.safe_load(Path(crd_yaml).read_text())
    version = next(v for v in crd["spec"]["versions"] if v["name"] == "v1beta1")
    schema = version["schema"]["openAPIV3Schema"]
    spec = schema["properties"]["spec"]
    pred = spec["properties"]["predictor"]["properties"]
    frameworks = ("huggingface", "lightgbm", "model", "onnx", "paddle", "pmml", "pytorch", "sklearn", "tensorflow",
                  "triton", "xgboost")
    for f in frameworks:
        pred.pop(f, None)
    spec["properties"] = {"predictor": spec["properties"]["predictor"]}
    schema.pop("description", None)
    out = {"source": "kserve/kserve config/crd/full/serving.kserve.io_inferenceservices.yaml at commit aaac4e29 "
                     "(v0.20.0-rc0-104), spec.versions[v1beta1].schema.openAPIV3Schema; left out: the predictor's "
                     "per-framework specs (" + ", ".join(frameworks) + "), the transformer and the explainer",
           "schema": schema}
    (HERE / "kserve_v1beta1_inferenceservice_schema.json").write_text(json.dumps(out, sort_keys=True,
                                                                                separators=(",", ":")))


if __name__ == "__main__":
    {"k8s": k8s, "kserve": kserve}[sys.argv[1]](sys.argv[2])
