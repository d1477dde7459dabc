from reinforce.critic.main import main

main()
