"""The leases not released, indexed apart: the lease pages and /metrics count and list the held and
expired ones from it, never reading the released history (which grows with every grant)."""

from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [("leasing", "0001_initial")]

    operations = [
        migrations.AddIndex(
            model_name="lease",
            index=models.Index(
                condition=models.Q(released_at__isnull=True), fields=["expires_at"], name="leasing_lease_live_idx"
            ),
        ),
    ]
