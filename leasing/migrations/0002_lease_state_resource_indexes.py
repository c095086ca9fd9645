"""The leases not released and the released ones, each indexed apart in the lease pages' order
(resource): the Held and Expired tabs, the Released tab and their capped counts read only their own
state's rows, however many of the other state's rows sort before them (issue 41's attack at 1,000,000
released and 200,000 expired leases read the whole table for the Expired tab). The held leases need
no index of their own: ``leasing_lease_expires_idx`` reaches them apart from the history (a release
moves a lease's expiry to its release time). One partial index entry per write: an acquire or a
renewal writes the live one, a release the released one."""

from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [("leasing", "0001_initial")]

    operations = [
        migrations.AddIndex(
            model_name="lease",
            index=models.Index(
                condition=models.Q(released_at__isnull=True), fields=["resource"], name="leasing_lease_live_res_idx"
            ),
        ),
        migrations.AddIndex(
            model_name="lease",
            index=models.Index(
                condition=models.Q(released_at__isnull=False),
                fields=["resource"],
                name="leasing_lease_released_res_idx",
            ),
        ),
    ]
