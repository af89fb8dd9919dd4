from services.rollout.admission import admission_limit, may_admit, parse_version


def test_capacity_follows_areal_formula():
    # (max_staleness + version + 1) x groups_per_step groups may have begun, counted from group 0
    assert admission_limit(max_staleness=1, engine_version=0, version_offset=0, groups_per_step=4) == 8
    assert admission_limit(max_staleness=1, engine_version=3, version_offset=0, groups_per_step=4) == 20
    assert admission_limit(max_staleness=0, engine_version=2, version_offset=0, groups_per_step=4) == 12


def test_on_policy_admits_only_the_current_step():
    # max_staleness 0 under version 2: step 2 (groups 8..11) may start, step 3 may not
    assert may_admit(11, 0, 2, 0, 4) and not may_admit(12, 0, 2, 0, 4)


def test_bound_holds_for_every_admitted_group():
    # group g of step N admitted under version v is trained at version N + offset <= v + max_staleness
    for ms in range(3):
        for v in range(5):
            for offset in range(3):
                for g in range(60):
                    if may_admit(g, ms, v, offset, 4):
                        assert g // 4 + offset <= v + ms


def test_a_renumbered_trainer_tightens_admission():
    assert may_admit(7, 1, 0, 0, 4) and not may_admit(7, 1, 0, 1, 4)
    assert admission_limit(0, 0, 5, 4) == 0  # never negative


def test_engine_versions_parse():
    assert parse_version("7") == 7 and parse_version("default") == 0 and parse_version(None) == 0
