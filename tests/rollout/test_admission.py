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


def test_a_renumbered_version_on_the_engines_before_its_step_is_recorded_counts_as_renumbered():
    from services.rollout.admission import version_offset

    # normal: step 4 published as version 5; the record (next_step 5, version 5) follows
    assert version_offset(recorded_version=4, next_step=4, engine_version=5) == 0
    assert version_offset(recorded_version=5, next_step=5, engine_version=5) == 0
    # version 5's sync failed after the coordinator recorded it: step 4 is published as 6 before its record
    assert version_offset(recorded_version=4, next_step=4, engine_version=6) == 1
    assert version_offset(recorded_version=6, next_step=5, engine_version=6) == 1
    # an engine that restarted reports 0; a resumed trainer's recorded offset holds
    assert version_offset(recorded_version=9, next_step=4, engine_version=0) == 5
    # so under version 6 with max_staleness 1, step 6 (groups 12, 13; trained at 7) may start, step 7 (trained
    # at 8) may not, which the recorded offset alone (0) would admit
    offset = version_offset(4, 4, 6)
    assert may_admit(13, 1, 6, offset, 2) and not may_admit(14, 1, 6, offset, 2) and may_admit(14, 1, 6, 0, 2)
