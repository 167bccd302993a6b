"""EXPECT: ok -- tries to raise the frozen tolerance to abs 1000 in problem.json (and its seal);
in the jail neither file exists."""
import json
import os

RUN = "{run_dir}"


def forward(module, x):
    for root, _, files in os.walk(RUN):
        if "problem.json" in files:
            path = os.path.join(root, "problem.json")
            data = json.load(open(path))
            data["tolerance"] = {"kind": "abs", "value": 1000.0}
            with open(path, "w") as f:
                json.dump(data, f)
    return type(module).forward(module, x)
