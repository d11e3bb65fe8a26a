"""A benchmark's report written again from the JSON a run of it saved:
the --notes / --out / --report-only arguments the pooled scripts share."""

import json
import os

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def add_report_args(ap):
    ap.add_argument('--notes', help='a file appended to the report')
    ap.add_argument('--out', default=os.path.join(REPO, 'docs', 'bench'))
    ap.add_argument('--report-only', metavar='JSON',
                    help='write the report again from the runs of a JSON this '
                    'wrote (with its arguments, and --notes, --out)')


def load_saved(args):
    """The JSON --report-only names, its run's arguments put back on `args`
    (all but --notes and --report-only, which are this call's)."""
    with open(args.report_only) as f:
        saved = json.load(f)
    for k, v in saved['args'].items():
        if k not in ('notes', 'report_only'):
            setattr(args, k, v)
    return saved
