"""python -m hydraddp.kube --image IMAGE [flags] [overrides]: print the Kubeflow PyTorchJob for the composed config.

    python -m hydraddp.kube --image ghcr.io/me/trainer:1 launcher.nnodes=2 launcher.nproc_per_node=4 wrap=fsdp2 \\
        | kubectl apply -f -

The tracking URI comes from a Secret (``--tracking-secret``, key ``uri``): create it once with
``kubectl create secret generic hydraddp-tracking --from-literal=uri=http://mlflow:5000``. No secret value is ever
written into the manifest: ``tracking.uri=...`` on this command line is dropped, and other secret-looking overrides
are refused (pass them as ``${oc.env:NAME}`` from a Secret of your own).
"""

from __future__ import annotations

import argparse
import sys

from hydraddp.exit_codes import EXIT_INVALID


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m hydraddp.kube", description=__doc__.splitlines()[0])
    parser.add_argument("--image", required=True, help="the container image with hydraddp and your code")
    parser.add_argument("--name", default="hydraddp", help="the PyTorchJob's name (default: hydraddp)")
    parser.add_argument("--namespace", default=None)
    parser.add_argument("--tracking-secret", default="hydraddp-tracking",
                        help="the Secret whose key 'uri' holds the MLflow tracking URI (default: hydraddp-tracking)")
    parser.add_argument("--cpu", default=None, help="CPU limit and request per pod, e.g. 16")
    parser.add_argument("--memory", default=None, help="memory limit and request per pod, e.g. 64Gi")
    parser.add_argument("--gpus-per-node", type=int, default=None,
                        help="nvidia.com/gpu per pod (default: launcher.nproc_per_node with backend=nccl, else 0)")
    parser.add_argument("overrides", nargs="*", help="hydraddp overrides, as for python -m hydraddp")
    args = parser.parse_args(argv)

    from hydraddp.config.compose import compose
    from hydraddp.config.overrides import normalize_overrides
    from hydraddp.redaction import is_secret_key

    overrides = [o for o in normalize_overrides(args.overrides) if not o.startswith(("tracking.uri=", "+tracking.uri="))]
    secret = [o.split("=")[0] for o in overrides if is_secret_key(o.split("=")[0].lstrip("+~"))]
    if secret:
        print(f"hydraddp.kube: {', '.join(secret)} would be written into the manifest in clear. Put the value in a "
              "Secret, expose it to the pods as an environment variable, and pass KEY='${oc.env:NAME}'.",
              file=sys.stderr)
        return EXIT_INVALID
    try:
        cfg = compose(overrides)
    except Exception as exc:  # Hydra's composition errors: an unknown option, a misspelled key, a wrong type
        print(f"hydraddp.kube: invalid configuration: {exc}", file=sys.stderr)
        return EXIT_INVALID
    import yaml

    from hydraddp.clusters.pytorchjob import manifest

    try:
        job = manifest(cfg, overrides, image=args.image, name=args.name, namespace=args.namespace,
                       tracking_secret=args.tracking_secret, cpu=args.cpu, memory=args.memory,
                       gpus_per_node=args.gpus_per_node)
    except ValueError as exc:
        print(f"hydraddp.kube: {exc}", file=sys.stderr)
        return EXIT_INVALID
    print(yaml.safe_dump(job, sort_keys=False), end="")
    return 0


if __name__ == "__main__":
    from hydraddp.exit_codes import exit_without_teardown

    exit_without_teardown(main)
